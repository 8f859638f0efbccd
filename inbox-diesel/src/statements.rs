//! What every backend's statements do, as traits the backend folders implement
//! (`pg/`, `sqlite/`), and the claim's conflict rule written once: neutral, below
//! every backend, above only the row types.

use chrono::{DateTime, Utc};
use diesel::result::QueryResult;
use inbox_core::{ClaimKey, ConsumerGroup, OutboxRow, UnreadableRow};

use crate::knobs::Knobs;
use crate::rows::{
    ClaimRecord, ClaimRow, Claimed, DeadLetter, DeadOutboxRow, FailureUpdate, NewDeadLetter,
    NewOutbox, PurgeBatch, PurgeTarget, Stored,
};
use crate::ClaimStatus;

/// The statements every backend runs, on its own connection type.
pub trait ClaimOps: Sized {
    /// Claims rows (sorted by key) in one statement; returns (key, attempts) of the
    /// rows this transaction now owns, and the transaction's token with them.
    fn claim(
        conn: &mut Self,
        group: &ConsumerGroup,
        rows: &[ClaimRow<'_>],
        now: DateTime<Utc>,
        knobs: Knobs,
    ) -> QueryResult<Claimed>;

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
}

/// The claim reads that are the same diesel DSL on both backends, implemented once
/// for every connection type that runs them (`dsl.rs`).
pub trait SharedClaimOps: Sized {
    /// Reads one claim.
    fn read_claim(conn: &mut Self, key: &ClaimKey) -> QueryResult<Option<ClaimRecord>>;

    /// Reads a group's dead letters in id order.
    fn read_dead_letters(conn: &mut Self, group: &ConsumerGroup) -> QueryResult<Vec<DeadLetter>>;
}

/// The outbox statements every backend runs, on its own connection type.
pub trait OutboxOps: Sized {
    /// Takes the ordering locks of `stripes` (sorted, distinct) in that order, held to
    /// the end of the caller's transaction (PostgreSQL); nothing on SQLite.
    fn lock_ordering(conn: &mut Self, stripes: &[i32]) -> QueryResult<()>;

    /// Inserts a row unless its message key exists; returns its id if it did.
    fn insert_outbox(conn: &mut Self, row: &NewOutbox<'_>) -> QueryResult<Option<i64>>;

    /// Wakes relays at commit (PostgreSQL); nothing on SQLite.
    fn notify_enqueue(conn: &mut Self) -> QueryResult<()>;

    /// Leases up to `limit` due rows to `relay` until `until` (see
    /// [`OutboxStore::lease`]) and reads them, in id order; rows that cannot be read
    /// are returned apart, leased like the others. Each backend keeps the lease and
    /// the read together its own way (one statement, or one transaction), so that
    /// a lease whose read failed before its commit is taken back with it.
    fn lease_outbox(
        conn: &mut Self,
        relay: &str,
        limit: i64,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> QueryResult<(Vec<OutboxRow>, Vec<UnreadableRow>)>;
}

/// The outbox statements that are the same diesel DSL on both backends, implemented
/// once for every connection type that runs them (`dsl.rs`).
pub trait SharedOutboxOps: Sized {
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
}

/// A recorded halt: (group, message key, detail, halted at).
pub(crate) type HaltRow = (String, String, String, DateTime<Utc>);

/// The group-halt statements every backend runs: a consumer records and reads halts.
pub trait HaltOps: Sized {
    /// Records a group's halt unless one is recorded; returns whether it wrote one.
    #[doc(hidden)]
    fn op_record_halt(conn: &mut Self, halt: &HaltRow) -> QueryResult<bool>;

    /// Every recorded halt, by group.
    #[doc(hidden)]
    fn op_halts(conn: &mut Self) -> QueryResult<Vec<HaltRow>>;

    /// Deletes a group's halt; returns how many rows it deleted (0 or 1).
    #[doc(hidden)]
    fn op_delete_halt(conn: &mut Self, group: &str) -> QueryResult<usize>;
}

/// The retention statement every backend runs.
pub trait RetentionOps: Sized {
    /// Deletes up to `limit` rows of `target` older than `cutoff`, oldest first,
    /// starting at `from` (the previous batch's `resume_from`), in the caller's
    /// transaction. Rows another transaction holds are skipped, never waited for.
    fn purge_batch(
        conn: &mut Self,
        target: PurgeTarget,
        cutoff: DateTime<Utc>,
        limit: i64,
        from: Option<DateTime<Utc>>,
    ) -> QueryResult<PurgeBatch>;

    /// How many rows a purge of `target` with `cutoff` would delete now (the same
    /// rows as [`purge_batch`](Self::purge_batch), counted, locked or not).
    fn count_purgeable(
        conn: &mut Self,
        target: PurgeTarget,
        cutoff: DateTime<Utc>,
    ) -> QueryResult<i64>;
}

/// How a claim upsert meets a row already under its claim key.
///
/// The conflict target is the claim key ([`ClaimKey::COLUMNS`]); an existing row is
/// taken over only if it is failed or started with the same payload digest and, where
/// the statement asks, due: digest and due time are part of the conflict condition,
/// so a colliding or not-yet-due row is never taken over. Every claim upsert of both
/// backends (the claim, the start mark, the broker's dead mark) uses this one rule.
pub(crate) struct ClaimConflict {
    /// The conflict target's column list: `consumer_group, message_key`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // PostgreSQL's statements
    pub target: String,
    /// The condition, up to the due time's parameter when there is one.
    pub condition: String,
    /// What follows the due time's parameter (empty without one).
    pub close: &'static str,
}

/// Builds the conflict target and condition of a claim upsert from [`ClaimKey`];
/// with `due`, the row must also be due at a time the caller binds right after
/// `condition`.
pub(crate) fn claim_conflict(due: bool) -> ClaimConflict {
    let mut condition = format!(
        "inbox_claims.status IN ('{}', '{}') \
         AND inbox_claims.payload_digest = excluded.payload_digest",
        ClaimStatus::Failed.as_str(),
        ClaimStatus::Started.as_str()
    );
    if due {
        condition.push_str(
            " AND (inbox_claims.next_attempt_at IS NULL OR inbox_claims.next_attempt_at <= ",
        );
    }
    ClaimConflict {
        target: ClaimKey::COLUMNS.join(", "),
        condition,
        close: if due { ")" } else { "" },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conflict_target_is_the_claim_key() {
        assert_eq!(claim_conflict(false).target, "consumer_group, message_key");
        let due = claim_conflict(true);
        assert!(
            due.condition.ends_with("next_attempt_at <= "),
            "{}",
            due.condition
        );
        assert_eq!(due.close, ")");
        let any = claim_conflict(false);
        assert!(
            !any.condition.contains("next_attempt_at"),
            "{}",
            any.condition
        );
        assert!(any.condition.contains("status IN ('failed', 'started')"));
        assert!(any
            .condition
            .contains("payload_digest = excluded.payload_digest"));
    }
}
