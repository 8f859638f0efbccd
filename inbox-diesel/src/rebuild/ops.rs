//! What a projection rebuild asks of a backend: the statements' trait the backend
//! folders implement (`pg/rebuild.rs`, `sqlite/rebuild.rs`), the columns they touch,
//! and the diesel DSL both share. Neutral: below every backend, it names none.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryResult;

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
pub trait RebuildOps: crate::backend::StoreConnection {
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

/// The statements both backends share (diesel expands them per connection type);
/// `$insert` is how a backend inserts the new covered claims.
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

        fn shared_release(conn: &mut $conn, name: &str, me: &str) -> diesel::QueryResult<()> {
            use crate::rebuild::ops::tables::inbox_rebuild_runs::dsl::*;
            use diesel::prelude::*;
            diesel::delete(
                inbox_rebuild_runs
                    .filter(projection.eq(name))
                    .filter(runner.eq(me)),
            )
            .execute(conn)
            .map(|_| ())
        }

        /// The existing claims of a chunk of covered keys: `failed`/`started` become
        /// done and covered, `dead` becomes covered with its dead letters resolved,
        /// `done` stays.
        fn shared_take_over(
            conn: &mut $conn,
            c: &crate::rebuild::ops::CoverClaims<'_>,
            chunk: &[&str],
            out: &mut crate::rebuild::ops::Covered,
        ) -> diesel::QueryResult<()> {
            use crate::rebuild::ops::tables::covered_claims::dsl::*;
            use crate::rebuild::ops::tables::resolved_letters::dsl as letters;
            use crate::ClaimStatus;
            use diesel::prelude::*;
            let mine = || {
                covered_claims
                    .filter(consumer_group.eq(c.group))
                    .filter(message_key.eq_any(chunk))
            };
            out.converted += diesel::update(mine().filter(
                status.eq_any([ClaimStatus::Failed.as_str(), ClaimStatus::Started.as_str()]),
            ))
            .set((
                status.eq(ClaimStatus::Done.as_str()),
                payload.eq(None::<Vec<u8>>),
                payload_digest.eq(crate::rebuild::ops::NO_DIGEST),
                next_attempt_at.eq(None::<crate::schema::Stamp>),
                covered_at.eq(Some(crate::schema::Stamp(c.now))),
                updated_at.eq(crate::schema::Stamp(c.now)),
            ))
            .execute(conn)? as u64;
            let dead: Vec<String> = diesel::update(
                mine()
                    .filter(status.eq(ClaimStatus::Dead.as_str()))
                    .filter(covered_at.is_null()),
            )
            .set((
                payload.eq(None::<Vec<u8>>),
                payload_digest.eq(crate::rebuild::ops::NO_DIGEST),
                covered_at.eq(Some(crate::schema::Stamp(c.now))),
                updated_at.eq(crate::schema::Stamp(c.now)),
            ))
            .returning(message_key)
            .get_results(conn)?;
            out.dead += dead.len() as u64;
            if !dead.is_empty() {
                // A key collision's letter is another payload's: not this event's.
                out.letters_resolved += diesel::update(
                    letters::resolved_letters
                        .filter(letters::consumer_group.eq(c.group))
                        .filter(letters::message_key.eq_any(&dead))
                        .filter(letters::resolved_at.is_null())
                        .filter(
                            letters::reason.ne(inbox_core::DeadLetterReason::KeyCollision.as_str()),
                        ),
                )
                .set(letters::resolved_at.eq(Some(crate::schema::Stamp(c.now))))
                .execute(conn)? as u64;
            }
            Ok(())
        }
    };
}
pub(crate) use rebuild_dsl;
