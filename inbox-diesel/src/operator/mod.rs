//! The operator API: dead letters listed, shown, grouped by failure, replayed through
//! the outbox to their group alone, discarded; failed claims redriven; halted consumer
//! groups listed and resumed; stats.
//!
//! # Every write decided by a guarded statement
//!
//! Every write is one short transaction decided by guarded statements, never by a
//! read before them: the guard updates (or locks) the row the decision depends on, and
//! the write is judged by the rows each statement touched. A read may pick candidates
//! (bulk actions) or an answer (why nothing happened), never a write. Per write, its
//! guard, what a concurrent writer of the same row finds, and the test that forces
//! the race (`store_seams` and `store_operator` are this crate's tests,
//! `projection_rebuild` the workspace's):
//!
//! - **replay** ([`Operator::replay_dead_letter`]): first marks the letter replayed
//!   `WHERE discarded_at IS NULL AND replayed_at IS NULL AND resolved_at IS NULL`, then,
//!   only if that touched the row, takes the claim `WHERE status = 'dead' AND
//!   payload_digest = <the letter's>`; only if both touched their row is the copy
//!   enqueued, otherwise the transaction rolls back (the mark too). The letter stays
//!   locked from the mark to the commit, so a discard, a second replay or a rebuild's
//!   cover waits for it and then finds it replayed; one that committed first leaves
//!   the replay nothing to mark (`Discarded`, `ClaimNotDead`, or `Refused` for a
//!   resolved letter). Tests: `store_seams` `races::a_replay_queued_behind_a_discard_is_refused`,
//!   `races::a_discard_during_a_replay_is_never_followed_by_the_replay`,
//!   `races::two_replays_of_one_letter_at_once_enqueue_one_copy`,
//!   `a_letter_is_replayed_once` (the rollback, and a replayed letter never replayed
//!   again); `projection_rebuild` `operator_writes::*` (against a rebuild's cover).
//! - **bulk replay** ([`Operator::replay_dead_letters`]): the filter's read only picks
//!   candidates; each is a replay as above, counted by its answer (refused: its reason
//!   or resolved; skipped: discarded, replayed or claim not dead meanwhile). Tests:
//!   `projection_rebuild` `operator_writes::a_bulk_replay_landing_inside_the_cover_counts_its_event_once`,
//!   `a_replay_before_or_after_a_rebuild_counts_its_event_once`.
//! - **discard** ([`Operator::discard_dead_letter`]): `SET discarded_at WHERE id = $1 AND
//!   discarded_at IS NULL`; one row touched is `Discarded`, none `AlreadyDiscarded` or
//!   `NotFound` (read after). Against a replay, whichever takes the letter first
//!   commits first: a replay after the discard enqueues nothing; a discard after a
//!   replay archives a replayed letter whose copy is out already (it is never
//!   replayed again). Tests: `store_seams`
//!   `races::a_discard_queued_behind_a_replay_comes_after_it`,
//!   `races::a_replay_queued_behind_a_discard_is_refused`,
//!   `a_replay_after_a_discard_enqueues_nothing`.
//! - **redrive** ([`Operator::redrive_failed_claims`]): marks the claim `WHERE status =
//!   'failed' AND updated_at = <as read> AND payload IS NOT NULL` (two redrives at once
//!   send one copy), then enqueues. Against a rebuild's cover, which locks the claim:
//!   a redrive that commits first leaves a failed claim the cover converts (its copy a
//!   duplicate); one after finds the claim done and skips it. Tests: `store_operator`
//!   `a_failed_claim_whose_retry_copy_was_lost_is_redriven_once`; `projection_rebuild`
//!   `operator_writes::a_redrive_racing_the_cover_counts_its_event_once`.
//! - **revive** (`Store::revive_outbox_rows`): `WHERE dead_at IS NOT NULL AND
//!   published_at IS NULL`, judged by rows touched (test: `store_outbox`
//!   `a_row_that_fails_its_last_attempt_is_dead_listed_and_holds_up_nothing`).
//! - **resume** ([`Operator::resume_group`]): deletes the group's halt row; one row
//!   deleted is `true`, so of two resumes at once one says it resumed (test:
//!   `store_operator` `a_halt_is_recorded_listed_and_resumed_once`).
//! - **purge** ([`Operator::purge_discarded_dead_letters`] and the retention purges):
//!   deletes rows matching the purge's condition `FOR UPDATE SKIP LOCKED`, so a row a
//!   replay, a discard or a rebuild's cover holds is left for the next purge, never
//!   waited for (tests: `store_retention`
//!   `racing_purges_delete_every_old_discarded_letter_once_and_nothing_else`,
//!   `a_purge_skips_claims_a_running_transaction_holds_instead_of_waiting`).
//!
//! The lock order across writers is letter, then claim: a replay marks its letter,
//! then takes its claim; a rebuild's cover locks the letters of its keys (by id),
//! then their claims (by key). No two of them wait for each other in a circle.
//!
//! # Replay sequences
//!
//! A replay carries its key's next sequence ([`REPLAY_SEQUENCE_HEADER`], and the
//! outbox's `(message_key, replay_seq)`). It is counted on a row of its own per key,
//! `inbox_replay_sequences`, raised under the row's lock in the replay's transaction,
//! and no purge deletes that row: a sequence never repeats for a key when the
//! published outbox rows that carried the earlier ones are purged (it used to be
//! `max(replay_seq) + 1` over the outbox, which restarted at 1; test: `store_seams`
//! `a_replay_sequence_never_repeats_across_a_purge`). A counter rather than a random
//! value: the sequence is an ordinal an operator reads ("replay 2 failed again") and
//! part of the outbox's unique key, an `INTEGER` that a random 128-bit value would
//! have to replace in every outbox row. What a counter does not survive is a failover
//! that loses committed transactions: the counter's row goes back with the outbox
//! rows it numbered, and a copy published from a lost row shares its sequence with
//! the next replay. That copy's identity at a consumer is its message key (the claim
//! absorbs a second arrival), not its sequence, which only links a letter to the
//! replay that delivered it (`delivered_by_replay`).

mod canary;
mod catalog;
mod fingerprint;
mod gauges;
mod halts;
pub(crate) mod ops;
mod reasons;
pub(crate) mod tables;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_core::{payload_digest, REPLAY_GROUP_HEADER, REPLAY_SEQUENCE_HEADER};

use crate::backend::StoreConnection;
use crate::{ClaimRecord, ClaimStatus, Error, Result, Store};

pub use crate::halts::HaltedGroup;
pub use canary::{Canary, CanaryPing, CanaryReport, CANARY_GROUP, CANARY_MESSAGE_TYPE};
pub(crate) use catalog::{check as check_schema, CatalogOps, OperatorCatalog, UniqueIndex};
pub(crate) use ops::{operator_ops, OperatorOps};

/// A connection type the operator's statements run on: `PgConnection` or
/// `SqliteConnection`, as [`StoreConnection`] is for the inbox path.
///
/// Sealed, as `StoreConnection` is. Code generic over the backend that uses the
/// operator's methods (dead letters, replay, redrive, stats, canaries) bounds its
/// connection type by this trait; the inbox path never needs it.
pub trait OperatorConnection: StoreConnection + OperatorOps + CatalogOps {}

impl<C: StoreConnection + OperatorOps + CatalogOps> OperatorConnection for C {}
pub use reasons::replay_refusal;

use ops::{EntryTuple, NewReplay};

/// Where a dead letter stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum LetterStatus {
    /// Neither replayed nor discarded.
    Pending,
    /// Replayed (and not discarded).
    Replayed,
    /// Resolved by a projection rebuild that counted its event (and not discarded):
    /// never replayed (a replay would count the event a second time).
    Resolved,
    /// Discarded (archived): kept for its retention, never replayed.
    Discarded,
}

impl LetterStatus {
    /// The status as the CLI and JSON name it: `pending`, `replayed`, `resolved`,
    /// `discarded`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Replayed => "replayed",
            Self::Resolved => "resolved",
            Self::Discarded => "discarded",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s names.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "replayed" => Self::Replayed,
            "resolved" => Self::Resolved,
            "discarded" => Self::Discarded,
            _ => return None,
        })
    }
}

/// Which dead letters an operator call is about. Every field narrows; the default
/// matches every letter that is not discarded.
///
/// ```
/// use inbox_diesel::operator::{DeadLetterFilter, LetterStatus};
/// let filter = DeadLetterFilter::default()
///     .consumer_group("billing.daily-usage")
///     .reason("max_attempts")
///     .status(LetterStatus::Pending);
/// assert_eq!(filter.reason.as_deref(), Some("max_attempts"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// The consumer group.
    pub consumer_group: Option<String>,
    /// The reason (`max_attempts`, `permanent`, ...).
    pub reason: Option<String>,
    /// The message type.
    pub message_type: Option<String>,
    /// The message key.
    pub message_key: Option<String>,
    /// Dead-lettered at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before this time.
    pub until: Option<DateTime<Utc>>,
    /// The failure group's fingerprint (see [`FailureGroup`]).
    pub failure_group: Option<String>,
    /// The status; `None` matches every letter that is not discarded (pending,
    /// replayed and resolved ones).
    pub status: Option<LetterStatus>,
}

impl DeadLetterFilter {
    /// Only this consumer group.
    pub fn consumer_group(mut self, group: impl Into<String>) -> Self {
        self.consumer_group = Some(group.into());
        self
    }

    /// Only this reason.
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// Only this message type.
    pub fn message_type(mut self, message_type: impl Into<String>) -> Self {
        self.message_type = Some(message_type.into());
        self
    }

    /// Only this message key.
    pub fn message_key(mut self, key: impl Into<String>) -> Self {
        self.message_key = Some(key.into());
        self
    }

    /// Only letters dead-lettered at or after `at`.
    pub fn since(mut self, at: DateTime<Utc>) -> Self {
        self.since = Some(at);
        self
    }

    /// Only letters dead-lettered before `at`.
    pub fn until(mut self, at: DateTime<Utc>) -> Self {
        self.until = Some(at);
        self
    }

    /// Only this failure group.
    pub fn failure_group(mut self, fingerprint: impl Into<String>) -> Self {
        self.failure_group = Some(fingerprint.into());
        self
    }

    /// Only letters of this status.
    pub fn status(mut self, status: LetterStatus) -> Self {
        self.status = Some(status);
        self
    }
}

/// A dead letter as a list shows it (no payload).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterEntry {
    /// The letter's id.
    pub id: i64,
    /// The consumer group.
    pub consumer_group: String,
    /// The message key.
    pub message_key: String,
    /// The message type.
    pub message_type: String,
    /// The tenant.
    pub tenant: Option<String>,
    /// Why it was dead-lettered.
    pub reason: String,
    /// Handled failures when it was dead-lettered.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// When it was dead-lettered.
    pub dead_lettered_at: DateTime<Utc>,
    /// How often it was replayed.
    pub replay_count: i32,
    /// When it was last replayed.
    pub replayed_at: Option<DateTime<Utc>>,
    /// When it was discarded.
    pub discarded_at: Option<DateTime<Utc>>,
    /// When a projection rebuild resolved it (counted its event).
    pub resolved_at: Option<DateTime<Utc>>,
    /// Its failure group's fingerprint.
    pub failure_group: String,
    /// Where it stands.
    pub status: LetterStatus,
    /// The replay that delivered this message, when it failed again after a replay:
    /// its [`REPLAY_SEQUENCE_HEADER`], shown only where the store replayed an earlier
    /// letter of the same group and key (a publisher can set the header itself).
    pub delivered_by_replay: Option<i32>,
}

/// One dead letter in full.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterDetails {
    /// What a list shows.
    pub entry: DeadLetterEntry,
    /// The payload, as delivered; only its first `inbox_core::CUT_PAYLOAD_PREFIX`
    /// bytes when `payload_cut` is set.
    pub payload: Vec<u8>,
    /// The whole body's length and SHA-256 when the payload was cut (a body over the
    /// consumer's `max_body_bytes`, dead-lettered `malformed`).
    pub payload_cut: Option<inbox_core::PayloadCut>,
    /// The transport headers, as delivered.
    pub headers: BTreeMap<String, String>,
    /// When this message was first dead-lettered in this group (any letter of its key).
    pub first_failure_at: DateTime<Utc>,
    /// When it was last dead-lettered in this group.
    pub last_failure_at: DateTime<Utc>,
    /// Its claim's status now, if it has a claim.
    pub claim_status: Option<ClaimStatus>,
    /// Why it cannot be replayed, if it cannot (see [`replay_refusal`]).
    pub replay_refusal: Option<&'static str>,
}

/// Dead letters that failed the same way: the same reason, message type, error kind
/// and first line of the error once numbers and ids are masked.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailureGroup {
    /// 16 hex digits over reason, message type, kind and masked line.
    pub fingerprint: String,
    /// The reason.
    pub reason: String,
    /// The message type.
    pub message_type: String,
    /// The error's kind: the outermost error's message (first line, before its first
    /// `:`), masked.
    pub kind: String,
    /// The error's first line, masked (`<n>` for numbers, `<id>` for ids).
    pub signature: String,
    /// How many letters.
    pub count: u64,
    /// The consumer groups they are in.
    pub consumer_groups: Vec<String>,
    /// The oldest letter's time.
    pub first_seen: DateTime<Utc>,
    /// The newest letter's time.
    pub last_seen: DateTime<Utc>,
    /// Whether its reason is replayable.
    pub replayable: bool,
}

/// How a replay addresses a consumer group: through the default exchange to the
/// group's own queue, `<queue_prefix><group>` (as `inbox_amqp::Topology::queue` names
/// it with the same prefix). The in-process transport reads the group from the
/// [`REPLAY_GROUP_HEADER`] instead.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayTarget {
    /// The topology's name prefix (empty by default).
    pub queue_prefix: String,
}

impl ReplayTarget {
    /// A target whose queues carry this prefix.
    pub fn with_prefix(prefix: impl Into<String>) -> Self {
        Self {
            queue_prefix: prefix.into(),
        }
    }

    /// The queue a group's replays go to.
    pub fn queue(&self, group: &str) -> String {
        format!("{}{group}", self.queue_prefix)
    }
}

/// What a replay of one letter did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayOutcome {
    /// The claim was reset and the message enqueued on the outbox for its group.
    Replayed {
        /// The replay's sequence for this message key (1, 2, ...).
        sequence: i32,
        /// The outbox row's id.
        outbox_id: i64,
    },
    /// Its reason is not replayable (see [`replay_refusal`]).
    Refused {
        /// The letter's reason.
        reason: String,
        /// What to do instead.
        advice: &'static str,
    },
    /// Its claim is not `dead` with this letter's payload (already replayed and in
    /// flight or done, or held by another payload): nothing was enqueued.
    ClaimNotDead {
        /// The claim's status, if it has a claim.
        status: Option<ClaimStatus>,
    },
    /// It is discarded.
    Discarded,
    /// No letter has this id.
    NotFound,
}

/// What a discard of one letter did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiscardOutcome {
    /// Discarded now.
    Discarded,
    /// It was discarded already.
    AlreadyDiscarded,
    /// No letter has this id.
    NotFound,
}

/// What a bulk action did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BulkReport {
    /// Letters (or claims) the filter matched, up to the limit.
    pub matched: u64,
    /// How many were replayed, discarded or redriven.
    pub affected: u64,
    /// Refused for their reason.
    pub refused: u64,
    /// Skipped because the guard found nothing to do (a claim no longer dead, a
    /// letter discarded meanwhile, a claim that changed since it was read).
    pub skipped: u64,
}

/// Which failed claims a redrive sends again.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedriveFilter {
    /// Only this consumer group.
    pub consumer_group: Option<String>,
    /// Only this message key.
    pub message_key: Option<String>,
    /// Only claims due, and unchanged, for at least this long (their retry copy is
    /// overdue: lost). Default 60 s.
    pub overdue_for: Duration,
}

impl Default for RedriveFilter {
    fn default() -> Self {
        Self {
            consumer_group: None,
            message_key: None,
            overdue_for: Duration::from_secs(60),
        }
    }
}

impl RedriveFilter {
    /// Only this consumer group.
    pub fn consumer_group(mut self, group: impl Into<String>) -> Self {
        self.consumer_group = Some(group.into());
        self
    }

    /// Only this message key.
    pub fn message_key(mut self, key: impl Into<String>) -> Self {
        self.message_key = Some(key.into());
        self
    }

    /// Only claims overdue for at least this long.
    pub fn overdue_for(mut self, overdue: Duration) -> Self {
        self.overdue_for = overdue;
        self
    }
}

/// One consumer group's claims.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupStats {
    /// The consumer group.
    pub consumer_group: String,
    /// Claims by status.
    pub started: u64,
    /// Done.
    pub done: u64,
    /// Failed (a retry pending).
    pub failed: u64,
    /// Dead.
    pub dead: u64,
    /// Failed claims whose retry is due.
    pub retries_due: u64,
    /// Failed claims whose retry is not due yet.
    pub retries_waiting: u64,
    /// The earliest `next_attempt_at` of a failed claim: the retry pending longest.
    pub oldest_pending_retry: Option<DateTime<Utc>>,
    /// When the oldest message not processed yet (a failed or started claim) was
    /// first seen.
    pub oldest_unprocessed_at: Option<DateTime<Utc>>,
}

/// Pending dead letters of a group and reason.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LetterCount {
    /// The consumer group.
    pub consumer_group: String,
    /// The reason.
    pub reason: String,
    /// How many, neither replayed nor discarded.
    pub count: u64,
}

/// The store's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OperatorStats {
    /// Per consumer group, by name.
    pub groups: Vec<GroupStats>,
    /// Pending dead letters by group and reason.
    pub dead_letters: Vec<LetterCount>,
    /// Live outbox rows not published yet.
    pub outbox_backlog: u64,
    /// The age of the oldest of them.
    pub oldest_unpublished_age: Option<Duration>,
    /// Outbox rows whose last publication attempt failed.
    pub dead_outbox_rows: u64,
    /// The halted consumer groups, by name (see
    /// [`resume_group`](Operator::resume_group)).
    pub halted: Vec<HaltedGroup>,
    /// When the figures were read (the store's clock).
    pub at: DateTime<Utc>,
}

/// What a purge with these windows deletes (or, in a dry run, would delete).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Published outbox rows.
    pub published_outbox_rows: u64,
    /// `done` claims.
    pub done_claims: u64,
    /// Discarded dead letters.
    pub discarded_dead_letters: u64,
}

/// Headers a replayed copy does not carry over: the broker's own (`x-...`) and an
/// earlier replay's.
fn replay_headers(stored: &str, group: &str, sequence: i32) -> String {
    let mut headers: BTreeMap<String, String> = serde_json::from_str(stored).unwrap_or_default();
    headers.retain(|k, _| !k.starts_with("x-") && !k.starts_with("inbox-replay-"));
    headers.insert(REPLAY_GROUP_HEADER.to_owned(), group.to_owned());
    headers.insert(REPLAY_SEQUENCE_HEADER.to_owned(), sequence.to_string());
    serde_json::to_string(&headers).unwrap_or_else(|_| "{}".to_owned())
}

fn entry(t: EntryTuple) -> DeadLetterEntry {
    let headers: BTreeMap<String, String> = serde_json::from_str(&t.5).unwrap_or_default();
    let signature = fingerprint::signature(&t.7, &t.3, t.8.as_deref());
    let status = if t.12.is_some() {
        LetterStatus::Discarded
    } else if t.13.is_some() {
        LetterStatus::Resolved
    } else if t.10.is_some() {
        LetterStatus::Replayed
    } else {
        LetterStatus::Pending
    };
    DeadLetterEntry {
        id: t.0,
        consumer_group: t.1,
        message_key: t.2,
        message_type: t.3,
        tenant: t.4,
        attempts: t.6,
        reason: t.7,
        last_error: t.8,
        dead_lettered_at: t.9,
        replayed_at: t.10,
        replay_count: t.11,
        discarded_at: t.12,
        resolved_at: t.13,
        failure_group: signature.fingerprint,
        status,
        delivered_by_replay: headers
            .get(REPLAY_SEQUENCE_HEADER)
            .and_then(|s| s.parse().ok()),
    }
}

/// A delivery's [`REPLAY_SEQUENCE_HEADER`] is the publisher's to set: it is a
/// replay's provenance only where the store replayed an earlier letter of the same
/// group and key; otherwise `delivered_by_replay` is `None`.
fn confirm_replay<C: OperatorConnection>(
    conn: &mut C,
    mut e: DeadLetterEntry,
) -> Result<DeadLetterEntry> {
    if e.delivered_by_replay.is_some()
        && !C::op_replayed_before(conn, &e.consumer_group, &e.message_key, e.id)?
    {
        e.delivered_by_replay = None;
    }
    Ok(e)
}

fn as_limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// How often a replay is tried again after contention, or when a replay sequence
/// written before the counter existed took the number.
const SEQUENCE_RETRIES: u32 = 5;

/// Why a resolved letter is not replayed.
const RESOLVED_ADVICE: &str = "a projection rebuild counted this event already (the letter is \
     resolved): a replay would count it twice; discard the letter";

/// Ends a replay's transaction without writing: an answer decided by a guard (the
/// transaction rolls back, so a letter marked before the claim's guard failed is
/// unmarked), or a database error.
enum Undo {
    Answer(ReplayOutcome),
    Database(diesel::result::Error),
}

impl From<diesel::result::Error> for Undo {
    fn from(err: diesel::result::Error) -> Self {
        Self::Database(err)
    }
}

/// The operator's handle on a store: dead letters (list, show, failure groups,
/// replay, discard, purge), a key's claims and their redrive, stats, halted groups,
/// canaries and gauges. Built from a store, whose pool and clock it shares; cheap to
/// clone.
///
/// ```no_run
/// # fn demo(store: &inbox_diesel::Store<diesel::PgConnection>) -> inbox_diesel::Result<()> {
/// use inbox_diesel::operator::{DeadLetterFilter, Operator};
///
/// let operator = Operator::new(store);
/// for letter in operator.list_dead_letters(&DeadLetterFilter::default(), 20, 0)? {
///     println!("{} {} {}", letter.id, letter.message_key, letter.reason);
/// }
/// # Ok(()) }
/// ```
pub struct Operator<C: StoreConnection> {
    store: Store<C>,
}

impl<C: StoreConnection> Clone for Operator<C> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
        }
    }
}

impl<C: StoreConnection> std::fmt::Debug for Operator<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operator").finish_non_exhaustive()
    }
}

impl<C: OperatorConnection> Operator<C> {
    /// The operator's handle on `store`.
    pub fn new(store: &Store<C>) -> Self {
        Self {
            store: store.clone(),
        }
    }

    /// The store it works on.
    pub fn store(&self) -> &Store<C> {
        &self.store
    }

    fn connection(&self) -> Result<crate::PooledStoreConnection<C>> {
        self.store.connection()
    }

    fn clock(&self) -> &std::sync::Arc<dyn inbox_core::Clock> {
        self.store.clock()
    }

    fn purge(&self, target: crate::PurgeTarget, window: Duration, batch: usize) -> Result<u64> {
        self.store.purge(target, window, batch)
    }
}

impl<C: OperatorConnection> Operator<C> {
    /// Dead letters matching `filter`, newest first: `limit` of them after skipping
    /// `offset`.
    pub fn list_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<DeadLetterEntry>> {
        let mut conn = self.connection()?;
        let entries: Vec<DeadLetterEntry> = match &filter.failure_group {
            None => C::op_entries(&mut conn, filter, Some(as_limit(limit)), as_limit(offset))?
                .into_iter()
                .map(entry)
                .collect(),
            // The fingerprint is computed, not stored: filter after reading.
            Some(fp) => C::op_entries(&mut conn, filter, None, 0)?
                .into_iter()
                .map(entry)
                .filter(|e| e.failure_group == *fp)
                .skip(offset)
                .take(limit)
                .collect(),
        };
        entries
            .into_iter()
            .map(|e| confirm_replay::<C>(&mut conn, e))
            .collect()
    }

    /// One dead letter in full, or `None`.
    pub fn dead_letter_details(&self, id: i64) -> Result<Option<DeadLetterDetails>> {
        let mut conn = self.connection()?;
        let Some((tuple, (payload, length, sha256))) = C::op_entry(&mut conn, id)? else {
            return Ok(None);
        };
        let payload_cut =
            crate::rows::payload_cut(length, sha256.as_deref()).map_err(|problem| {
                diesel::result::Error::DeserializationError(
                    format!("dead letter {id}: {problem}").into(),
                )
            })?;
        let headers = serde_json::from_str(&tuple.5).unwrap_or_default();
        let entry = confirm_replay::<C>(&mut conn, entry(tuple))?;
        let (first, last) =
            C::op_failure_span(&mut conn, &entry.consumer_group, &entry.message_key)?;
        let claim_status = C::op_claim_state(&mut conn, &entry.consumer_group, &entry.message_key)?
            .and_then(|(status, _)| ClaimStatus::parse(&status));
        Ok(Some(DeadLetterDetails {
            first_failure_at: first.unwrap_or(entry.dead_lettered_at),
            last_failure_at: last.unwrap_or(entry.dead_lettered_at),
            // A letter a rebuild resolved is never replayable, discarded since or not:
            // the rebuild counted its event.
            replay_refusal: match entry.resolved_at {
                Some(_) => Some(RESOLVED_ADVICE),
                None => replay_refusal(&entry.reason),
            },
            payload,
            payload_cut,
            headers,
            claim_status,
            entry,
        }))
    }

    /// Failure groups of the letters matching `filter`, largest first.
    pub fn failure_groups(&self, filter: &DeadLetterFilter) -> Result<Vec<FailureGroup>> {
        let mut conn = self.connection()?;
        let rows = C::op_entries(&mut conn, filter, None, 0)?;
        let mut groups: BTreeMap<String, (FailureGroup, BTreeSet<String>)> = BTreeMap::new();
        for t in rows {
            let sig = fingerprint::signature(&t.7, &t.3, t.8.as_deref());
            if filter
                .failure_group
                .as_ref()
                .is_some_and(|fp| *fp != sig.fingerprint)
            {
                continue;
            }
            let (group, members) = groups.entry(sig.fingerprint.clone()).or_insert_with(|| {
                (
                    FailureGroup {
                        fingerprint: sig.fingerprint.clone(),
                        replayable: replay_refusal(&t.7).is_none(),
                        reason: t.7.clone(),
                        message_type: t.3.clone(),
                        kind: sig.kind.clone(),
                        signature: sig.line.clone(),
                        count: 0,
                        consumer_groups: Vec::new(),
                        first_seen: t.9,
                        last_seen: t.9,
                    },
                    BTreeSet::new(),
                )
            });
            group.count += 1;
            group.first_seen = group.first_seen.min(t.9);
            group.last_seen = group.last_seen.max(t.9);
            members.insert(t.1);
        }
        let mut out: Vec<FailureGroup> = groups
            .into_values()
            .map(|(mut g, members)| {
                g.consumer_groups = members.into_iter().collect();
                g
            })
            .collect();
        out.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then(b.last_seen.cmp(&a.last_seen))
                .then(a.fingerprint.cmp(&b.fingerprint))
        });
        Ok(out)
    }

    /// Replays one dead letter, in one transaction decided by two guarded writes,
    /// never by a read before them: first the letter is marked replayed where it is
    /// neither discarded, nor replayed, nor resolved by a rebuild; only then is its
    /// claim taken where it is `dead` with the letter's payload digest (it becomes a
    /// due `failed` claim with no attempts or starts). Only if both touched their row
    /// is an outbox row enqueued for the letter's group alone, with the original
    /// message key and the key's next replay sequence; otherwise the transaction rolls
    /// back and nothing was written.
    pub fn replay_dead_letter(&self, id: i64, target: &ReplayTarget) -> Result<ReplayOutcome> {
        let mut conn = self.connection()?;
        let mut tries = 0;
        loop {
            let now = self.clock().now();
            let attempt = C::write_transaction(&mut *conn, |conn| {
                let Some(letter) = C::op_letter(conn, id)? else {
                    return Err(Undo::Answer(ReplayOutcome::NotFound));
                };
                // The reason never changes: read once, it decides nothing that a
                // concurrent writer could change.
                if let Some(advice) = replay_refusal(&letter.reason) {
                    // Nothing is written either way: the read only picks the answer.
                    if letter.discarded {
                        return Err(Undo::Answer(ReplayOutcome::Discarded));
                    }
                    return Err(Undo::Answer(ReplayOutcome::Refused {
                        reason: letter.reason,
                        advice,
                    }));
                }
                // The guard on the letter: a discard, a replay or a rebuild that
                // committed first leaves nothing to mark (and one still open holds the
                // row until it commits).
                if C::op_mark_replayed(conn, letter.id, now)? != 1 {
                    return Err(Undo::Answer(Self::why_not_replayed(conn, &letter)?));
                }
                let digest = payload_digest(&letter.payload);
                // The guard on the claim: only the transaction that takes the dead
                // claim enqueues (a rebuild's cover empties the digest).
                let took = C::op_reset_dead_claim(
                    conn,
                    &letter.group,
                    &letter.key,
                    &digest,
                    &letter.payload,
                    now,
                )?;
                if took != 1 {
                    let status = C::op_claim_state(conn, &letter.group, &letter.key)?
                        .and_then(|(s, _)| ClaimStatus::parse(&s));
                    return Err(Undo::Answer(ReplayOutcome::ClaimNotDead { status }));
                }
                let sequence = C::op_next_sequence(conn, &letter.key)?;
                let headers = replay_headers(&letter.headers, &letter.group, sequence);
                let routing_key = target.queue(&letter.group);
                let outbox_id = C::op_insert_replay(
                    conn,
                    &NewReplay {
                        key: &letter.key,
                        routing_key: &routing_key,
                        message_type: &letter.message_type,
                        tenant: letter.tenant.as_deref(),
                        payload: &letter.payload,
                        headers: &headers,
                        sequence,
                        now,
                    },
                )?;
                C::notify_enqueue(conn)?;
                Ok::<_, Undo>(ReplayOutcome::Replayed {
                    sequence,
                    outbox_id,
                })
            });
            match attempt {
                Ok(outcome) => {
                    metrics::counter!("inbox_replays_total", "kind" => "replay").increment(1);
                    tracing::info!(id, ?outcome, "dead letter replayed");
                    return Ok(outcome);
                }
                Err(Undo::Answer(outcome)) => return Ok(outcome),
                // An older sequence the counter does not know of (written before the
                // counter existed) took the number: the next try takes the next one.
                Err(Undo::Database(diesel::result::Error::DatabaseError(
                    diesel::result::DatabaseErrorKind::UniqueViolation,
                    _,
                ))) if tries < SEQUENCE_RETRIES => tries += 1,
                Err(Undo::Database(err))
                    if crate::backend::is_retryable(&err) && tries < SEQUENCE_RETRIES =>
                {
                    tries += 1;
                }
                Err(Undo::Database(err)) => return Err(err.into()),
            }
        }
    }

    /// Why a letter's guarded mark touched nothing, read after the guard (in the same
    /// transaction, which rolls back).
    fn why_not_replayed(
        conn: &mut C,
        letter: &ops::Letter,
    ) -> std::result::Result<ReplayOutcome, diesel::result::Error> {
        Ok(match C::op_letter(conn, letter.id)? {
            None => ReplayOutcome::NotFound,
            Some(now) if now.discarded => ReplayOutcome::Discarded,
            Some(now) if now.resolved => ReplayOutcome::Refused {
                reason: now.reason,
                advice: RESOLVED_ADVICE,
            },
            // Replayed already: its claim says where that replay stands.
            Some(now) => ReplayOutcome::ClaimNotDead {
                status: C::op_claim_state(conn, &now.group, &now.key)?
                    .and_then(|(s, _)| ClaimStatus::parse(&s)),
            },
        })
    }

    /// Replays up to `limit` letters matching `filter` (oldest of the newest first:
    /// the filter's order), each in its own transaction; see
    /// [`replay_dead_letter`](Self::replay_dead_letter).
    pub fn replay_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: Option<usize>,
        target: &ReplayTarget,
    ) -> Result<BulkReport> {
        let ids = self.matching_ids(filter, limit)?;
        let mut report = BulkReport {
            matched: ids.len() as u64,
            ..BulkReport::default()
        };
        for id in ids {
            match self.replay_dead_letter(id, target)? {
                ReplayOutcome::Replayed { .. } => report.affected += 1,
                ReplayOutcome::Refused { .. } => report.refused += 1,
                _ => report.skipped += 1,
            }
        }
        Ok(report)
    }

    /// Discards (archives) one letter: kept until a purge of discarded letters, never
    /// replayed, listed only when asked for.
    pub fn discard_dead_letter(&self, id: i64) -> Result<DiscardOutcome> {
        let now = self.clock().now();
        let mut conn = self.connection()?;
        Ok(C::write_transaction(&mut *conn, |conn| {
            if C::op_discard(conn, id, now)? == 1 {
                return Ok::<_, diesel::result::Error>(DiscardOutcome::Discarded);
            }
            Ok(match C::op_letter(conn, id)? {
                Some(_) => DiscardOutcome::AlreadyDiscarded,
                None => DiscardOutcome::NotFound,
            })
        })?)
    }

    /// Discards up to `limit` letters matching `filter`.
    pub fn discard_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: Option<usize>,
    ) -> Result<BulkReport> {
        let ids = self.matching_ids(filter, limit)?;
        let mut report = BulkReport {
            matched: ids.len() as u64,
            ..BulkReport::default()
        };
        for id in ids {
            match self.discard_dead_letter(id)? {
                DiscardOutcome::Discarded => report.affected += 1,
                _ => report.skipped += 1,
            }
        }
        Ok(report)
    }

    fn matching_ids(&self, filter: &DeadLetterFilter, limit: Option<usize>) -> Result<Vec<i64>> {
        Ok(self
            .list_dead_letters(filter, 0, limit.unwrap_or(usize::MAX))?
            .into_iter()
            .map(|e| e.id)
            .collect())
    }

    /// Every claim of a message key, one per consumer group.
    pub fn claims_for_key(&self, key: &str) -> Result<Vec<ClaimRecord>> {
        let mut conn = self.connection()?;
        C::op_claims_by_key(&mut conn, key)?
            .into_iter()
            .map(|t| {
                let status = ClaimStatus::parse(&t.4).ok_or_else(|| {
                    Error::Database(diesel::result::Error::DeserializationError(
                        format!("unknown claim status {:?}", t.4).into(),
                    ))
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
            })
            .collect()
    }

    /// Sends failed claims again whose retry copy was lost: due, and unchanged, for at
    /// least `filter.overdue_for`, with their payload kept. Each is marked by a write
    /// guarded by the `updated_at` it was read with (so two redrives at once send it
    /// once) and enqueued for its group alone, like a replay. A copy that was only
    /// late, not lost, is then a duplicate of the redriven one: the claim absorbs it.
    pub fn redrive_failed_claims(
        &self,
        filter: &RedriveFilter,
        limit: Option<usize>,
        target: &ReplayTarget,
    ) -> Result<BulkReport> {
        let now = self.clock().now();
        // A window reaching before year 1 starts there: nothing is that overdue.
        let cutoff = inbox_core::earlier_by(now, filter.overdue_for);
        let mut conn = self.connection()?;
        let candidates = C::op_redrivable(
            &mut conn,
            filter.consumer_group.as_deref(),
            filter.message_key.as_deref(),
            cutoff,
            as_limit(limit.unwrap_or(usize::MAX)),
        )?;
        let mut report = BulkReport {
            matched: candidates.len() as u64,
            ..BulkReport::default()
        };
        for claim in candidates {
            let mut tries = 0;
            loop {
                let attempt = C::write_transaction(&mut *conn, |conn| {
                    if C::op_touch_redriven(conn, &claim.group, &claim.key, claim.updated_at, now)?
                        != 1
                    {
                        return Ok(false);
                    }
                    let sequence = C::op_next_sequence(conn, &claim.key)?;
                    let headers = replay_headers("{}", &claim.group, sequence);
                    let routing_key = target.queue(&claim.group);
                    C::op_insert_replay(
                        conn,
                        &NewReplay {
                            key: &claim.key,
                            routing_key: &routing_key,
                            message_type: &claim.message_type,
                            tenant: claim.tenant.as_deref(),
                            payload: &claim.payload,
                            headers: &headers,
                            sequence,
                            now,
                        },
                    )?;
                    C::notify_enqueue(conn)?;
                    Ok::<_, diesel::result::Error>(true)
                });
                match attempt {
                    Ok(true) => {
                        metrics::counter!("inbox_replays_total", "kind" => "redrive").increment(1);
                        report.affected += 1;
                    }
                    Ok(false) => report.skipped += 1,
                    Err(diesel::result::Error::DatabaseError(
                        diesel::result::DatabaseErrorKind::UniqueViolation,
                        _,
                    )) if tries < SEQUENCE_RETRIES => {
                        tries += 1;
                        continue;
                    }
                    Err(err) => return Err(err.into()),
                }
                break;
            }
        }
        Ok(report)
    }

    /// Claims by status per group, retries due and waiting, the oldest pending retry,
    /// pending dead letters by group and reason, the outbox backlog, its oldest
    /// unpublished row's age, dead outbox rows, and the halted consumer groups.
    pub fn operator_stats(&self) -> Result<OperatorStats> {
        let now = self.clock().now();
        let halted = self.list_halted_groups()?;
        let mut conn = self.connection()?;
        let raw = C::op_stats(&mut conn, now)?;
        let mut groups: BTreeMap<String, GroupStats> = BTreeMap::new();
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        for (group, status, n) in raw.claims {
            let g = groups.entry(group.clone()).or_insert_with(|| GroupStats {
                consumer_group: group,
                ..GroupStats::default()
            });
            match ClaimStatus::parse(&status) {
                Some(ClaimStatus::Started) => g.started += count(n),
                Some(ClaimStatus::Done) => g.done += count(n),
                Some(ClaimStatus::Failed) => g.failed += count(n),
                Some(ClaimStatus::Dead) => g.dead += count(n),
                _ => {}
            }
        }
        for (group, n) in raw.due {
            if let Some(g) = groups.get_mut(&group) {
                g.retries_due = count(n);
            }
        }
        for (group, at) in raw.oldest_retry {
            if let Some(g) = groups.get_mut(&group) {
                g.oldest_pending_retry = at;
            }
        }
        for (group, at) in raw.oldest_unprocessed {
            if let Some(g) = groups.get_mut(&group) {
                g.oldest_unprocessed_at = at;
            }
        }
        for g in groups.values_mut() {
            g.retries_waiting = g.failed.saturating_sub(g.retries_due);
        }
        Ok(OperatorStats {
            groups: groups.into_values().collect(),
            dead_letters: raw
                .letters
                .into_iter()
                .map(|(consumer_group, reason, n)| LetterCount {
                    consumer_group,
                    reason,
                    count: count(n),
                })
                .collect(),
            outbox_backlog: count(raw.backlog),
            oldest_unpublished_age: raw
                .oldest_unpublished
                .map(|at| (now - at).to_std().unwrap_or(Duration::ZERO)),
            dead_outbox_rows: count(raw.dead_outbox),
            halted,
            at: now,
        })
    }

    /// Counts what a purge would delete: outbox rows published longer than
    /// `retention.published()` ago, `done` claims older than `retention.done_claims()`,
    /// dead letters discarded longer than `discarded` ago.
    pub fn count_purgeable(
        &self,
        retention: &crate::Retention,
        discarded: Duration,
    ) -> Result<PurgeReport> {
        let now = self.clock().now();
        // As the purges: a window reaching before year 1 counts nothing.
        let before = |d: Duration| inbox_core::earlier_by(now, d);
        let mut conn = self.connection()?;
        let (published, done, letters) = C::op_count_purgeable(
            &mut conn,
            before(retention.published()),
            before(retention.done_claims()),
            before(discarded),
        )?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(PurgeReport {
            published_outbox_rows: count(published),
            done_claims: count(done),
            discarded_dead_letters: count(letters),
        })
    }

    /// Deletes dead letters discarded longer than `window` ago, at most `batch` per
    /// transaction, until a batch deletes fewer; returns how many. Concurrency as for
    /// [`purge_done_claims`](crate::Store::purge_done_claims): on PostgreSQL one purge of
    /// discarded letters runs at a time per schema, a second one returns at once.
    pub fn purge_discarded_dead_letters(&self, window: Duration, batch: usize) -> Result<u64> {
        self.purge(crate::PurgeTarget::DiscardedDeadLetters, window, batch)
    }
}

/// Runs the operator migration's checks (see `Store::verify_schema`).
pub(crate) fn verify<C: OperatorConnection>(conn: &mut C) -> Result<()> {
    check_schema(&C::op_catalog(conn)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_names_its_group_and_sequence_and_drops_broker_headers() {
        let stored = r#"{"x-death":"q","inbox-replay-sequence":"1","tenant":"acme"}"#;
        let headers: BTreeMap<String, String> =
            serde_json::from_str(&replay_headers(stored, "billing.daily-usage", 2)).unwrap();
        assert_eq!(headers[REPLAY_GROUP_HEADER], "billing.daily-usage");
        assert_eq!(headers[REPLAY_SEQUENCE_HEADER], "2");
        assert_eq!(headers["tenant"], "acme");
        assert!(!headers.contains_key("x-death"));
    }

    #[test]
    fn statuses_round_trip() {
        for s in [
            LetterStatus::Pending,
            LetterStatus::Replayed,
            LetterStatus::Discarded,
        ] {
            assert_eq!(LetterStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(LetterStatus::parse("dead"), None);
    }
}
