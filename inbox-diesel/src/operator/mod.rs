//! The operator API: dead letters listed, shown, grouped by failure, replayed through
//! the outbox to their group alone, discarded; failed claims redriven; halted consumer
//! groups listed and resumed; stats; activity per group; stored rebuild reports.
//!
//! # Reads that stay bounded
//!
//! A console renders these reads on every page, on stores of any size, so each is an
//! index read:
//!
//! - [`Operator::list_dead_letters`] and [`Operator::failure_groups`] filter and group
//!   by the fingerprint every letter stores (`failure_group`, indexed with
//!   `dead_lettered_at` and `id`): the filter and its paging are SQL, the grouping a
//!   `GROUP BY` with one index read per group for its newest letter
//!   ([`FailureGroup::sample_error`]). Letters written before the column existed are
//!   filled when a store is built (`fingerprint.rs`, the backfill).
//! - [`Operator::activity`]: one bounded read per group and count, newest first, at
//!   most `cap` index entries each (see [`ActivityQuery`]): at most
//!   `2 x groups x cap` entries per call, whatever the buckets.
//! - [`Operator::rebuild_reports`]: the newest reports by `(projection, id)`.
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

mod activity;
mod canary;
mod catalog;
mod gauges;
mod halts;
pub mod json;
pub(crate) mod ops;
mod overview;
mod records;
mod shared;
pub(crate) mod tables;
mod types;
mod writes;

#[cfg(test)]
use writes::replay_headers;
use writes::RESOLVED_ADVICE;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use inbox_core::{payload_digest, REPLAY_GROUP_HEADER, REPLAY_SEQUENCE_HEADER};

use crate::backend::StoreConnection;
use crate::fingerprint;
use crate::{ClaimRecord, ClaimStatus, PurgeTarget, Result, Store};

pub use crate::halts::HaltedGroup;
pub use crate::reports::{
    RebuildOutcome, RebuildReportKind, StoredRebuildReport, KEPT_REBUILD_REPORTS,
    MAX_REPORT_ERROR_CHARS,
};
pub use activity::{
    Activity, ActivityBucket, ActivityQuery, Count, GroupActivity, MAX_ACTIVITY_BUCKETS,
};
pub use canary::{Canary, CanaryPing, CanaryReport, CANARY_GROUP, CANARY_MESSAGE_TYPE};
pub(crate) use ops::{operator_ops, OperatorOps};
pub use overview::{GroupOverview, OutboxSummary, Overview};

/// A connection type the operator's statements run on: `PgConnection` or
/// `SqliteConnection`, as [`StoreConnection`] is for the inbox path.
///
/// Sealed, as `StoreConnection` is. Code generic over the backend that uses the
/// operator's methods (dead letters, replay, redrive, stats, canaries) bounds its
/// connection type by this trait; the inbox path never needs it.
pub trait OperatorConnection: StoreConnection + OperatorOps {}

impl<C: StoreConnection + OperatorOps> OperatorConnection for C {}
pub use types::{
    BulkReport, DeadLetterDetails, DeadLetterEntry, DeadLetterFilter, DiscardOutcome, FailureGroup,
    GroupStats, LetterCount, LetterStatus, OperatorStats, PurgeReport, RedriveFilter,
    ReplayOutcome, ReplayTarget,
};

use ops::{EntryRow, NewReplay};

/// A listed letter, or a deserialization error for a reason this version does not know.
pub(super) fn entry(t: EntryRow) -> diesel::QueryResult<DeadLetterEntry> {
    let reason = crate::rows::stored_reason(format_args!("dead letter {}", t.id), &t.reason)?;
    let headers: BTreeMap<String, String> = serde_json::from_str(&t.headers).unwrap_or_default();
    // Stored with the letter; a letter the backfill has not reached yet (written by
    // an older binary) is fingerprinted here.
    let failure_group = t.failure_group.unwrap_or_else(|| {
        fingerprint::signature(reason.as_str(), &t.message_type, t.last_error.as_deref())
            .fingerprint
    });
    let status = if t.discarded_at.is_some() {
        LetterStatus::Discarded
    } else if t.resolved_at.is_some() {
        LetterStatus::Resolved
    } else if t.replayed_at.is_some() {
        LetterStatus::Replayed
    } else {
        LetterStatus::Pending
    };
    Ok(DeadLetterEntry {
        id: t.id,
        consumer_group: t.consumer_group,
        message_key: t.message_key,
        message_type: t.message_type,
        tenant: t.tenant,
        attempts: t.attempts,
        reason,
        last_error: t.last_error,
        dead_lettered_at: t.dead_lettered_at,
        replayed_at: t.replayed_at,
        replay_count: t.replay_count,
        discarded_at: t.discarded_at,
        resolved_at: t.resolved_at,
        failure_group,
        status,
        delivered_by_replay: headers
            .get(REPLAY_SEQUENCE_HEADER)
            .and_then(|s| s.parse().ok()),
    })
}

/// The longest [`FailureGroup::sample_error`], in characters.
pub const SAMPLE_ERROR_CHARS: usize = 500;

/// A failure group of one letter (its newest), from its reason, message type and
/// error: fingerprint, kind, signature and sample error computed here.
fn failure_group(sample: &ops::FailureSample) -> diesel::QueryResult<FailureGroup> {
    let reason =
        crate::rows::stored_reason(format_args!("dead letter {}", sample.id), &sample.reason)?;
    let last_error = sample.last_error.as_deref();
    let sig = fingerprint::signature(reason.as_str(), &sample.message_type, last_error);
    Ok(FailureGroup {
        fingerprint: sig.fingerprint,
        replayable: reason.replay_refusal().is_none(),
        reason,
        message_type: sample.message_type.clone(),
        kind: sig.kind,
        signature: sig.line,
        count: 1,
        consumer_groups: vec![sample.consumer_group.clone()],
        first_seen: sample.dead_lettered_at,
        last_seen: sample.dead_lettered_at,
        sample_error: last_error.map(|e| e.chars().take(SAMPLE_ERROR_CHARS).collect()),
    })
}

/// The failure group's fingerprint of a failure: 16 lower-case hex digits over the
/// reason (its stored name, `max_attempts`, ...), the message type, and the error's
/// kind and first line with numbers and ids masked. Every dead letter stores it
/// ([`DeadLetterEntry::failure_group`]); the same failure with other numbers has the
/// same one.
///
/// ```
/// use inbox_diesel::operator::failure_fingerprint;
/// let a = failure_fingerprint("max_attempts", "usage.recorded", Some("row 17 locked"));
/// let b = failure_fingerprint("max_attempts", "usage.recorded", Some("row 9 locked"));
/// assert_eq!(a, b);
/// assert_eq!(a.len(), 16);
/// ```
pub fn failure_fingerprint(reason: &str, message_type: &str, last_error: Option<&str>) -> String {
    fingerprint::signature(reason, message_type, last_error).fingerprint
}

/// A delivery's [`REPLAY_SEQUENCE_HEADER`] is the publisher's to set: it is a
/// replay's provenance only where the store replayed an earlier letter of the same
/// group and key; otherwise `delivered_by_replay` is `None`.
pub(super) fn confirm_replay<C: OperatorConnection>(
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

pub(super) fn as_limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
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
    /// The labelled gauges [`publish_operator_gauges`](Self::publish_operator_gauges)
    /// set last, shared by the clones.
    published: gauges::Published,
}

impl<C: StoreConnection> Clone for Operator<C> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            published: std::sync::Arc::clone(&self.published),
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
            published: gauges::Published::default(),
        }
    }

    /// The store it works on.
    pub fn store(&self) -> &Store<C> {
        &self.store
    }

    pub(super) fn connection(&self) -> Result<crate::PooledStoreConnection<C>> {
        self.store.connection()
    }

    pub(super) fn clock(&self) -> &std::sync::Arc<dyn inbox_core::Clock> {
        self.store.clock()
    }

    pub(super) fn purge(
        &self,
        target: crate::PurgeTarget,
        window: Duration,
        batch: usize,
    ) -> Result<u64> {
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
        // The failure group is a stored, indexed column: filtered and paged in SQL.
        let entries: Vec<DeadLetterEntry> =
            C::op_entries(&mut conn, filter, Some(as_limit(limit)), as_limit(offset))?
                .into_iter()
                .map(entry)
                .collect::<diesel::QueryResult<_>>()?;
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
        let headers = serde_json::from_str(&tuple.headers).unwrap_or_default();
        let entry = confirm_replay::<C>(&mut conn, entry(tuple)?)?;
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
                None => entry.reason.replay_refusal(),
            },
            payload,
            payload_cut,
            headers,
            claim_status,
            entry,
        }))
    }

    /// Failure groups of the letters matching `filter`, largest first.
    ///
    /// Counted in SQL by the stored fingerprint (one scan: `GROUP BY failure_group,
    /// reason, consumer_group`), then one index read per group for its newest
    /// letter, whose
    /// reason, message type and error give the group's `kind`, `signature` and
    /// `sample_error`. Letters without a stored fingerprint (written by an older
    /// binary since the last backfill) are read and fingerprinted here.
    pub fn failure_groups(&self, filter: &DeadLetterFilter) -> Result<Vec<FailureGroup>> {
        self.top_failure_groups(filter, usize::MAX)
    }

    /// The `limit` largest failure groups of the letters matching `filter`, largest
    /// first: as [`failure_groups`](Self::failure_groups), with the per-group read of
    /// a sample letter done for those `limit` groups only (errors that differ by a
    /// word, not a number, make a group each: thousands of them must not cost a read
    /// each on every page).
    pub fn top_failure_groups(
        &self,
        filter: &DeadLetterFilter,
        limit: usize,
    ) -> Result<Vec<FailureGroup>> {
        let mut conn = self.connection()?;
        // Per (fingerprint, reason): letters, oldest, newest, consumer groups.
        type Counted = (
            u64,
            Option<chrono::DateTime<chrono::Utc>>,
            Option<chrono::DateTime<chrono::Utc>>,
            BTreeSet<String>,
        );
        let mut counted: BTreeMap<(Option<String>, String), Counted> = BTreeMap::new();
        for (print, reason, group, n, first, last) in C::op_failure_counts(&mut conn, filter)? {
            let c = counted.entry((print, reason)).or_default();
            c.0 += u64::try_from(n).unwrap_or(0);
            c.1 = c.1.into_iter().chain(first).min();
            c.2 = c.2.into_iter().chain(last).max();
            c.3.insert(group);
        }
        // The `limit` largest stored fingerprints (summed over reasons): only theirs
        // are sampled.
        let mut totals: BTreeMap<&str, u64> = BTreeMap::new();
        for ((print, _), c) in &counted {
            if let Some(p) = print {
                *totals.entry(p.as_str()).or_default() += c.0;
            }
        }
        let keep: Option<BTreeSet<String>> = (totals.len() > limit).then(|| {
            let mut ranked: Vec<(&str, u64)> = totals.into_iter().collect();
            ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
            ranked
                .into_iter()
                .take(limit)
                .map(|(p, _)| p.to_owned())
                .collect()
        });
        let mut groups: BTreeMap<String, (FailureGroup, BTreeSet<String>)> = BTreeMap::new();
        let mut unstored = false;
        for ((print, reason), (count, first, last, names)) in counted {
            let Some(print) = print else {
                // Not stored yet: fingerprinted letter by letter below.
                unstored = true;
                continue;
            };
            if keep.as_ref().is_some_and(|k| !k.contains(&print)) {
                continue;
            }
            let Some(sample) =
                C::op_failure_samples(&mut conn, filter, Some(&print), Some(&reason), 1)?
                    .into_iter()
                    .next()
            else {
                // Deleted between the two reads (a purge): nothing left to show.
                continue;
            };
            // Parsed for every stored reason: one this version does not know fails.
            let mut one = failure_group(&sample)?;
            one.fingerprint.clone_from(&print);
            one.count = count;
            one.first_seen = first.unwrap_or(sample.dead_lettered_at);
            one.last_seen = last.unwrap_or(sample.dead_lettered_at);
            match groups.get_mut(&print) {
                // The same fingerprint under another reason: edited behind the
                // store's back. One group; the newest letter is its sample.
                Some((group, members)) => {
                    members.extend(names);
                    group.count += one.count;
                    group.first_seen = group.first_seen.min(one.first_seen);
                    if one.last_seen > group.last_seen {
                        one.count = group.count;
                        one.first_seen = group.first_seen;
                        *group = one;
                    }
                }
                None => {
                    groups.insert(print, (one, names));
                }
            }
        }
        if unstored {
            for letter in C::op_failure_samples(&mut conn, filter, None, None, i64::MAX)? {
                let one = failure_group(&letter)?;
                let (group, names) = groups.entry(one.fingerprint.clone()).or_insert_with(|| {
                    (
                        FailureGroup {
                            count: 0,
                            ..one.clone()
                        },
                        BTreeSet::new(),
                    )
                });
                group.count += 1;
                group.first_seen = group.first_seen.min(one.first_seen);
                if one.last_seen > group.last_seen {
                    group.last_seen = one.last_seen;
                    group.sample_error = one.sample_error;
                }
                names.insert(letter.consumer_group);
            }
        }
        let mut out: Vec<FailureGroup> = groups
            .into_values()
            .map(|(mut g, names)| {
                g.consumer_groups = names.into_iter().collect();
                g
            })
            .collect();
        out.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then(b.last_seen.cmp(&a.last_seen))
                .then(a.fingerprint.cmp(&b.fingerprint))
        });
        out.truncate(limit);
        Ok(out)
    }

    pub(super) fn matching_ids(
        &self,
        filter: &DeadLetterFilter,
        limit: Option<usize>,
    ) -> Result<Vec<i64>> {
        Ok(self
            .list_dead_letters(filter, 0, limit.unwrap_or(usize::MAX))?
            .into_iter()
            .map(|e| e.id)
            .collect())
    }

    /// Every claim of a message key, one per consumer group.
    pub fn claims_for_key(&self, key: &str) -> Result<Vec<ClaimRecord>> {
        let mut conn = self.connection()?;
        Ok(C::op_claims_by_key(&mut conn, key)?)
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
                .map(|(consumer_group, reason, n)| {
                    Ok(LetterCount {
                        reason: crate::rows::stored_reason(
                            format_args!("dead letters of {consumer_group}"),
                            &reason,
                        )?,
                        consumer_group,
                        count: count(n),
                    })
                })
                .collect::<diesel::QueryResult<_>>()?,
            outbox_backlog: count(raw.backlog),
            oldest_unpublished_age: raw
                .oldest_unpublished
                .map(|at| (now - at).to_std().unwrap_or(Duration::ZERO)),
            dead_outbox_rows: count(raw.dead_outbox),
            halted,
            at: now,
        })
    }

    /// Per consumer group (every group with claims or dead letters), claims that
    /// reached `done` and messages dead-lettered per `query.interval` over
    /// `query.buckets` intervals ending at the store clock's now, and in the last
    /// hour and day. Every count is a bounded index range read (see
    /// [`ActivityQuery`] for the bound, and [`Count::at_least`] for what a count
    /// that hit `query.cap` says).
    ///
    /// ```no_run
    /// # fn demo(store: &inbox_diesel::Store<diesel::PgConnection>) -> inbox_diesel::Result<()> {
    /// use inbox_diesel::operator::{ActivityQuery, Operator};
    ///
    /// let activity = Operator::new(store).activity(&ActivityQuery::default())?;
    /// for g in &activity.groups {
    ///     println!("{}: {} processed in the last hour", g.consumer_group, g.processed_last_hour.count);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: [`Error::InvalidSetting`](crate::Error::InvalidSetting) naming
    /// `buckets`, `interval` or `cap` for a query outside
    /// [`ActivityQuery::validate`]'s ranges.
    pub fn activity(&self, query: &ActivityQuery) -> Result<Activity> {
        query.validate()?;
        let now = self.clock().now();
        let window = activity::ScanWindow::new(now, query);
        let mut conn = self.connection()?;
        let mut groups = Vec::new();
        for group in C::op_groups_present(&mut conn)? {
            let processed =
                C::op_activity_scan(&mut conn, activity::Tally::Processed, &group, &window)?;
            let dead =
                C::op_activity_scan(&mut conn, activity::Tally::DeadLettered, &group, &window)?;
            groups.push(activity::group_activity(
                group, query, &window, processed, dead,
            ));
        }
        Ok(Activity {
            at: now,
            interval_secs: query.interval.as_secs(),
            groups,
        })
    }

    /// The stored reports of projection rebuilds and audits (see
    /// [`Rebuilder`](crate::rebuild::Rebuilder), which records one when a run
    /// finishes, ok or failed), newest first: `projection`'s, or every projection's,
    /// at most `limit`. The table keeps a projection's newest
    /// [`KEPT_REBUILD_REPORTS`]. Needs no rebuild hook and no `rebuild` feature.
    pub fn rebuild_reports(
        &self,
        projection: Option<&str>,
        limit: usize,
    ) -> Result<Vec<StoredRebuildReport>> {
        let mut conn = self.connection()?;
        Ok(C::read_reports(&mut conn, projection, as_limit(limit))?
            .into_iter()
            .map(crate::reports::ReportRow::into_report)
            .collect::<diesel::QueryResult<_>>()?)
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
        // The retention purge's own count: the same rows the purges delete.
        let mut count = |target, window| crate::count_purgeable(&mut *conn, target, before(window));
        Ok(PurgeReport {
            published_outbox_rows: count(PurgeTarget::PublishedOutboxRows, retention.published())?,
            done_claims: count(PurgeTarget::DoneClaims, retention.done_claims())?,
            discarded_dead_letters: count(PurgeTarget::DiscardedDeadLetters, discarded)?,
        })
    }
}

/// Runs the operator migration's checks (see `Store::verify_schema`).
pub(crate) fn verify<C: OperatorConnection>(conn: &mut C) -> Result<()> {
    catalog::check(conn)
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
