//! What a projection rebuild asks of a backend: the statements' trait the backend
//! folders implement (`pg/rebuild.rs`, `sqlite/rebuild.rs`), the columns they touch,
//! and the diesel DSL both share. Neutral: below every backend, it names none.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::connection::LoadConnection;
use diesel::dsl::{auto_type, delete, update};
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::query_dsl::LoadQuery;
use diesel::QueryResult;
use inbox_core::DeadLetterReason;

use crate::schema::Stamp;
use crate::ClaimStatus;
use tables::{covered_claims as cc, inbox_rebuild_runs as runs, resolved_letters as rl};

/// The digest of a covered claim: none (a rebuild reads the ledger, not the payload).
pub(crate) const NO_DIGEST: &[u8] = &[];

/// The claims a rebuild records for a partition's covered events.
pub struct CoverClaims<'a> {
    pub group: &'a str,
    pub message_type: &'a str,
    /// Sorted, each once: concurrent writers lock claim rows in one order.
    pub keys: &'a [&'a str],
    pub now: DateTime<Utc>,
}

/// What [`RebuildOps::cover`] did.
#[derive(Default)]
pub struct Covered {
    pub recorded: u64,
    pub converted: u64,
    pub dead: u64,
    pub letters_resolved: u64,
}

/// A runner's lease of a projection.
pub struct RunLease<'a> {
    pub projection: &'a str,
    pub runner: &'a str,
    pub now: DateTime<Utc>,
    pub until: DateTime<Utc>,
}

/// The statements of a rebuild, per backend (`rebuild/pg.rs`, `rebuild/sqlite.rs`).
pub trait RebuildOps: crate::backend::StoreConnection + crate::reports::ReportOps {
    /// Takes a projection lock exclusively for the rest of the transaction, waiting at
    /// most `timeout` (for the rest of the transaction, every lock wait is bounded so).
    /// Returns whether it had to wait (live batches held it).
    fn lock_exclusive(conn: &mut Self, key: i64, timeout: Duration) -> QueryResult<bool>;

    /// Runs `f` in a read-only transaction with one snapshot for all its statements.
    fn read_snapshot<T, E, F>(conn: &mut Self, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&mut Self) -> std::result::Result<T, E>,
        E: From<diesel::result::Error>;

    /// Records covered claims (see the module docs).
    fn cover(conn: &mut Self, claims: &CoverClaims<'_>) -> QueryResult<Covered>;

    /// Takes or renews the lease when it is free, expired or ours; returns who holds it
    /// afterwards.
    fn lease_run(conn: &mut Self, lease: &RunLease<'_>) -> QueryResult<String>;

    /// Gives the lease up, if it is still ours.
    fn release_run(conn: &mut Self, projection: &str, runner: &str) -> QueryResult<()>;
}

/// The diesel tables of the rebuild's statements, one set for both backends: only
/// the columns they touch.
pub(crate) mod tables {
    diesel::table! {
        use diesel::sql_types::*;
        use crate::schema::sql_types::StoreTime;

        #[sql_name = "inbox_claims"]
        covered_claims (consumer_group, message_key) {
            consumer_group -> Text,
            message_key -> Text,
            message_type -> Text,
            payload_digest -> Binary,
            status -> Text,
            attempts -> Integer,
            starts -> Integer,
            next_attempt_at -> Nullable<StoreTime>,
            payload -> Nullable<Binary>,
            first_seen_at -> StoreTime,
            updated_at -> StoreTime,
            covered_at -> Nullable<StoreTime>,
        }
    }

    diesel::table! {
        use diesel::sql_types::*;
        use crate::schema::sql_types::StoreTime;

        #[sql_name = "inbox_dead_letters"]
        resolved_letters (id) {
            id -> BigInt,
            consumer_group -> Text,
            message_key -> Text,
            reason -> Text,
            resolved_at -> Nullable<StoreTime>,
        }
    }

    diesel::table! {
        use diesel::sql_types::*;
        use crate::schema::sql_types::StoreTime;

        inbox_rebuild_runs (projection) {
            projection -> Text,
            runner -> Text,
            leased_until -> StoreTime,
        }
    }
}

/// The lease's upsert, the one statement both backends share that stays a macro
/// expanded per connection type: diesel names no type for an `ON CONFLICT ... DO
/// UPDATE`, so a generic function could not bound it (see [`take_over`]).
macro_rules! rebuild_dsl {
    ($conn:ty) => {
        fn shared_lease(
            conn: &mut $conn,
            l: &crate::rebuild::ops::RunLease<'_>,
        ) -> diesel::QueryResult<String> {
            use crate::rebuild::ops::tables::inbox_rebuild_runs::dsl::*;
            use diesel::prelude::*;
            use diesel::query_dsl::methods::FilterDsl;
            let took: Option<String> = diesel::insert_into(inbox_rebuild_runs)
                .values((
                    projection.eq(l.projection),
                    runner.eq(l.runner),
                    leased_until.eq(crate::schema::Stamp(l.until)),
                ))
                .on_conflict(projection)
                .do_update()
                .set((
                    runner.eq(l.runner),
                    leased_until.eq(crate::schema::Stamp(l.until)),
                ))
                // Free (expired) or ours: another runner's live lease is left alone.
                .filter(
                    leased_until
                        .le(crate::schema::Stamp(l.now))
                        .or(runner.eq(l.runner)),
                )
                .returning(runner)
                .get_result(conn)
                .optional()?;
            match took {
                Some(holder) => Ok(holder),
                None => QueryDsl::select(inbox_rebuild_runs.find(l.projection), runner).first(conn),
            }
        }
    };
}
pub(crate) use rebuild_dsl;

/// Gives the lease up, if it is still ours.
pub(crate) fn release<C>(conn: &mut C, name: &str, me: &str) -> QueryResult<()>
where
    C: Connection,
    release_run: ExecuteDsl<C>,
{
    release_run(name.to_owned(), me.to_owned())
        .execute(conn)
        .map(|_| ())
}

/// The existing claims of a chunk of covered keys: `failed`/`started` become done
/// and covered, `dead` becomes covered with its dead letters resolved, `done` stays.
///
/// A plain function for both backends, bounded per statement on `ExecuteDsl` or
/// `LoadQuery` of its `#[auto_type]` builder, as diesel advises for generic code. The
/// builders take owned keys: a statement type without a lifetime keeps each bound a
/// plain one (a borrowed one needs a higher-ranked `for<'a>` bound, which rustc does
/// not prove for the backends' connections: E0477).
pub(crate) fn take_over<C>(
    conn: &mut C,
    c: &CoverClaims<'_>,
    chunk: &[&str],
    out: &mut Covered,
) -> QueryResult<()>
where
    C: Connection + LoadConnection,
    convert_claims: ExecuteDsl<C>,
    cover_dead: LoadQuery<'static, C, String>,
    resolve_letters: ExecuteDsl<C>,
{
    let keys: Vec<String> = chunk.iter().map(|k| (*k).to_owned()).collect();
    let now = Stamp(c.now);
    out.converted += convert_claims(c.group.to_owned(), keys.clone(), now).execute(conn)? as u64;
    let dead: Vec<String> = cover_dead(c.group.to_owned(), keys, now).get_results(conn)?;
    out.dead += dead.len() as u64;
    if !dead.is_empty() {
        out.letters_resolved +=
            resolve_letters(c.group.to_owned(), dead, now).execute(conn)? as u64;
    }
    Ok(())
}

#[auto_type]
fn release_run(name: String, me: String) -> _ {
    delete(
        runs::table
            .filter(runs::projection.eq(name))
            .filter(runs::runner.eq(me)),
    )
}

#[auto_type]
fn convert_claims(group: String, keys: Vec<String>, now: Stamp) -> _ {
    let unfinished: [&'static str; 2] =
        [ClaimStatus::Failed.as_str(), ClaimStatus::Started.as_str()];
    let done: &'static str = ClaimStatus::Done.as_str();
    let no_payload: Option<Vec<u8>> = None;
    let no_digest: &'static [u8] = NO_DIGEST;
    let not_due: Option<Stamp> = None;
    let covered: Option<Stamp> = Some(now);
    update(
        cc::table
            .filter(cc::consumer_group.eq(group))
            .filter(cc::message_key.eq_any(keys))
            .filter(cc::status.eq_any(unfinished)),
    )
    .set((
        cc::status.eq(done),
        cc::payload.eq(no_payload),
        cc::payload_digest.eq(no_digest),
        cc::next_attempt_at.eq(not_due),
        cc::covered_at.eq(covered),
        cc::updated_at.eq(now),
    ))
}

#[auto_type]
fn cover_dead(group: String, keys: Vec<String>, now: Stamp) -> _ {
    let dead: &'static str = ClaimStatus::Dead.as_str();
    let no_payload: Option<Vec<u8>> = None;
    let no_digest: &'static [u8] = NO_DIGEST;
    let covered: Option<Stamp> = Some(now);
    update(
        cc::table
            .filter(cc::consumer_group.eq(group))
            .filter(cc::message_key.eq_any(keys))
            .filter(cc::status.eq(dead))
            .filter(cc::covered_at.is_null()),
    )
    .set((
        cc::payload.eq(no_payload),
        cc::payload_digest.eq(no_digest),
        cc::covered_at.eq(covered),
        cc::updated_at.eq(now),
    ))
    .returning(cc::message_key)
}

/// A key collision's letter is another payload's: not this event's.
#[auto_type]
fn resolve_letters(group: String, keys: Vec<String>, now: Stamp) -> _ {
    let collision: &'static str = DeadLetterReason::KeyCollision.as_str();
    let resolved: Option<Stamp> = Some(now);
    update(
        rl::table
            .filter(rl::consumer_group.eq(group))
            .filter(rl::message_key.eq_any(keys))
            .filter(rl::resolved_at.is_null())
            .filter(rl::reason.ne(collision)),
    )
    .set(rl::resolved_at.eq(resolved))
}
