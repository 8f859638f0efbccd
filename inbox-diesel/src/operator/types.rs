//! What the operator's handle takes and returns: filters, records, outcomes, reports.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_core::DeadLetterReason;

use crate::halts::HaltedGroup;
use crate::ClaimStatus;

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
/// use inbox_core::DeadLetterReason;
/// use inbox_diesel::operator::{DeadLetterFilter, LetterStatus};
/// let filter = DeadLetterFilter::default()
///     .consumer_group("billing.daily-usage")
///     .reason(DeadLetterReason::MaxAttempts)
///     .status(LetterStatus::Pending);
/// assert_eq!(filter.reason, Some(DeadLetterReason::MaxAttempts));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// The consumer group.
    pub consumer_group: Option<String>,
    /// The reason.
    pub reason: Option<DeadLetterReason>,
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
    pub fn reason(mut self, reason: DeadLetterReason) -> Self {
        self.reason = Some(reason);
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
    pub reason: DeadLetterReason,
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
    /// its [`REPLAY_SEQUENCE_HEADER`](inbox_core::REPLAY_SEQUENCE_HEADER), shown only where the store replayed an earlier
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
    /// Why it cannot be replayed, if it cannot (see
    /// [`DeadLetterReason::replay_refusal`]; a letter a rebuild resolved never is).
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
    pub reason: DeadLetterReason,
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
    /// The newest letter's last error, its first
    /// [`SAMPLE_ERROR_CHARS`](super::SAMPLE_ERROR_CHARS) characters (unmasked: the
    /// real numbers and ids of one occurrence); `None` when it had none.
    pub sample_error: Option<String>,
}

/// How a replay addresses a consumer group: through the default exchange to the
/// group's own queue, `<queue_prefix><group>` (as `inbox_amqp::Topology::queue` names
/// it with the same prefix). The in-process transport reads the group from the
/// [`REPLAY_GROUP_HEADER`](inbox_core::REPLAY_GROUP_HEADER) instead.
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
    /// Its reason is not replayable (see [`DeadLetterReason::replay_refusal`]), or a
    /// rebuild resolved it.
    Refused {
        /// The letter's reason.
        reason: DeadLetterReason,
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
    pub reason: DeadLetterReason,
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
    /// [`resume_group`](super::Operator::resume_group)).
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
