//! The rows the operator's statements read and write, shared by the statements
//! written once (`shared.rs`) and those each backend expands (`ops.rs`).

use chrono::{DateTime, Utc};
use inbox_core::DeadLetterReason;

/// A dead letter without its payload, as the operator's letters view reads it (the
/// fields in the view's column order: rows are read by position).
#[derive(diesel::Queryable)]
pub struct EntryRow {
    pub id: i64,
    pub consumer_group: String,
    pub message_key: String,
    pub message_type: String,
    pub tenant: Option<String>,
    pub headers: String,
    pub attempts: i32,
    pub reason: String,
    pub last_error: Option<String>,
    pub dead_lettered_at: DateTime<Utc>,
    pub replayed_at: Option<DateTime<Utc>>,
    pub replay_count: i32,
    pub discarded_at: Option<DateTime<Utc>>,
    pub resolved_at: Option<DateTime<Utc>>,
    /// The stored fingerprint; `None` for a letter the backfill has not reached.
    pub failure_group: Option<String>,
}

/// A letter's payload, and a cut payload's whole length and SHA-256.
pub(crate) type StoredPayload = (Vec<u8>, Option<i64>, Option<Vec<u8>>);

/// The first and last time a key was dead-lettered in a group.
pub(crate) type FailureSpan = (Option<DateTime<Utc>>, Option<DateTime<Utc>>);

/// A dead letter as a replay needs it.
pub struct Letter {
    pub id: i64,
    pub group: String,
    pub key: String,
    pub message_type: String,
    pub tenant: Option<String>,
    pub payload: Vec<u8>,
    pub headers: String,
    pub reason: DeadLetterReason,
    pub discarded: bool,
    pub resolved: bool,
}

/// An outbox row addressed to one group.
pub struct NewReplay<'a> {
    pub key: &'a str,
    pub routing_key: &'a str,
    pub message_type: &'a str,
    pub tenant: Option<&'a str>,
    pub payload: &'a [u8],
    pub headers: &'a str,
    pub sequence: i32,
    pub now: DateTime<Utc>,
}

/// A failed claim that may be redriven.
pub struct Redrivable {
    pub group: String,
    pub key: String,
    pub message_type: String,
    pub tenant: Option<String>,
    pub payload: Vec<u8>,
    pub updated_at: DateTime<Utc>,
}

/// What `stats` reads, raw.
#[derive(Default)]
pub struct RawStats {
    pub claims: Vec<(String, String, i64)>,
    pub due: Vec<(String, i64)>,
    pub oldest_retry: Vec<(String, Option<DateTime<Utc>>)>,
    pub oldest_unprocessed: Vec<(String, Option<DateTime<Utc>>)>,
    pub letters: Vec<(String, String, i64)>,
    pub backlog: i64,
    pub oldest_unpublished: Option<DateTime<Utc>>,
    pub dead_outbox: i64,
}

/// The overview's figures as read: failed and due claims per group, the outbox's
/// backlog, its oldest unpublished row, its dead rows.
#[derive(Debug, Default)]
pub struct RawOverview {
    pub failed: Vec<(String, i64)>,
    pub due: Vec<(String, i64)>,
    pub backlog: i64,
    pub oldest_unpublished: Option<DateTime<Utc>>,
    pub dead_outbox: i64,
}

/// One canary's arrivals: (seq, sent_at, first arrival, arrivals).
pub(crate) type CanaryRow = (i32, DateTime<Utc>, DateTime<Utc>, i32);

/// A failure group's figures as SQL counts them, per stored fingerprint, reason and
/// consumer group: (fingerprint, reason, consumer group, letters, oldest, newest); no
/// fingerprint for letters the backfill has not reached. The reason is part of the
/// fingerprint, so one reason per fingerprint but for rows edited behind the store's
/// back: grouping by it too keeps every stored reason read (an unknown one fails
/// loudly). The consumer group makes the same scan give the group's members.
pub(crate) type FailureCount = (
    Option<String>,
    String,
    String,
    i64,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
);

/// A failure group's newest letter (the fields in the statement's column order).
#[derive(diesel::Queryable)]
pub struct FailureSample {
    pub id: i64,
    pub reason: String,
    pub message_type: String,
    pub last_error: Option<String>,
    pub dead_lettered_at: DateTime<Utc>,
    pub consumer_group: String,
}
