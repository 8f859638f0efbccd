//! The rows the store's statements write and read, and the public records made of
//! them: neutral, below every backend (each backend's statements take and return
//! these).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::result::QueryResult;
use inbox_core::{
    DeadLetterReason, MessageKey, OutboxMessage, OutboxRow, PayloadCut, UnreadableRow,
};
use std::collections::BTreeMap;

use crate::schema::{inbox_claims, inbox_dead_letters, outbox_fates, outbox_messages};

/// A claim's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimStatus {
    /// A redelivered message's processing started (crash-loop detection).
    Started,
    /// The handler's effect committed.
    Done,
    /// The handler failed; a retry is due at `next_attempt_at`.
    Failed,
    /// Dead-lettered.
    Dead,
}

impl ClaimStatus {
    /// The status as stored.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Dead => "dead",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "started" => Self::Started,
            "done" => Self::Done,
            "failed" => Self::Failed,
            "dead" => Self::Dead,
            _ => return None,
        })
    }
}

/// A row of the claim table.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRecord {
    /// The consumer group.
    pub group: String,
    /// The message key.
    pub key: String,
    /// The message type.
    pub message_type: String,
    /// The tenant, informational.
    pub tenant: Option<String>,
    /// The state.
    pub status: ClaimStatus,
    /// Handled failures so far.
    pub attempts: i32,
    /// Starts of redelivered processing without an outcome since.
    pub starts: i32,
    /// When a retry is due.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The last failure.
    pub last_error: Option<String>,
    /// Whether the payload is kept (only while a retry is pending).
    pub has_payload: bool,
    /// When the claim was first made.
    pub first_seen_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

/// A row of the dead-letter table.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Surrogate id (a key collision dead-letters under an existing key).
    pub id: i64,
    /// The consumer group.
    pub group: String,
    /// The message key.
    pub key: String,
    /// The message type.
    pub message_type: String,
    /// The tenant.
    pub tenant: Option<String>,
    /// The payload, as delivered; only its first `inbox_core::CUT_PAYLOAD_PREFIX`
    /// bytes when `payload_cut` is set.
    pub payload: Vec<u8>,
    /// The whole body's length and SHA-256 when the payload was cut (a body over the
    /// consumer's limit, dead-lettered `malformed`).
    pub payload_cut: Option<PayloadCut>,
    /// The transport headers.
    pub headers: BTreeMap<String, String>,
    /// Handled failures when it was dead-lettered.
    pub attempts: i32,
    /// Why; stored as its text (`max_attempts`, `permanent`, `decode_error`,
    /// `key_collision`, `crash_loop`, `delivery_limit`, `no_handler`, `malformed`).
    pub reason: DeadLetterReason,
    /// The last failure.
    pub last_error: Option<String>,
    /// When.
    pub dead_lettered_at: DateTime<Utc>,
    /// When it was replayed, if it was.
    pub replayed_at: Option<DateTime<Utc>>,
}

/// A claim to insert.
pub struct ClaimRow<'a> {
    pub key: &'a str,
    pub message_type: &'a str,
    pub tenant: Option<&'a str>,
    pub digest: &'a [u8],
    pub payload: &'a [u8],
}

/// What a claim statement returned.
pub struct Claimed {
    /// (key, attempts) of the rows this transaction now owns.
    pub owned: Vec<(String, i32)>,
    /// The transaction's token, read by the claim statement itself (PostgreSQL, when
    /// it returned a row); see `transaction_token`.
    pub token: Option<String>,
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
    /// The whole body's length when `payload` is a cut prefix of it.
    pub payload_length: Option<i64>,
    /// The whole body's SHA-256 when `payload` is a cut prefix of it.
    pub payload_sha256: Option<&'a [u8]>,
}

/// A claim row as it is read back: the columns of [`ClaimRecord`], the payload only
/// as whether it is kept.
///
/// The read rows (this one, [`StoredDeadLetter`], [`StoredOutbox`],
/// [`StoredDeadOutbox`]) are `Queryable`, read by position from the column lists
/// of `dsl.rs` (`as_select()` is typed by the backend, and the statements'
/// `#[auto_type]` builders are not), and `Selectable`, which names each field's
/// column: a test holds each list to its row's fields, in order.
#[derive(Queryable, Selectable)]
#[diesel(table_name = inbox_claims)]
pub(crate) struct StoredClaim {
    pub(crate) consumer_group: String,
    pub(crate) message_key: String,
    pub(crate) message_type: String,
    pub(crate) tenant: Option<String>,
    pub(crate) status: String,
    pub(crate) attempts: i32,
    pub(crate) starts: i32,
    pub(crate) next_attempt_at: Option<DateTime<Utc>>,
    pub(crate) last_error: Option<String>,
    #[diesel(select_expression = inbox_claims::payload.is_not_null())]
    #[diesel(select_expression_type = diesel::dsl::IsNotNull<inbox_claims::payload>)]
    pub(crate) has_payload: bool,
    pub(crate) first_seen_at: DateTime<Utc>,
    pub(crate) updated_at: DateTime<Utc>,
}

/// A dead-letter row as it is read back, before its reason, headers and cut are
/// checked.
#[derive(Queryable, Selectable)]
#[diesel(table_name = inbox_dead_letters)]
pub(crate) struct StoredDeadLetter {
    pub(crate) id: i64,
    pub(crate) consumer_group: String,
    pub(crate) message_key: String,
    pub(crate) message_type: String,
    pub(crate) tenant: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) attempts: i32,
    pub(crate) reason: String,
    pub(crate) last_error: Option<String>,
    pub(crate) dead_lettered_at: DateTime<Utc>,
    pub(crate) replayed_at: Option<DateTime<Utc>>,
    pub(crate) payload_length: Option<i64>,
    pub(crate) payload_sha256: Option<Vec<u8>>,
}

/// The stored length and SHA-256 of a cut payload: both or neither.
pub(crate) fn payload_cut(
    length: Option<i64>,
    sha256: Option<&[u8]>,
) -> std::result::Result<Option<PayloadCut>, String> {
    match (length, sha256) {
        (None, None) => Ok(None),
        (Some(length), Some(sha256)) => {
            let length = u64::try_from(length)
                .map_err(|_| format!("payload_length {length} is negative"))?;
            let sha256 = <[u8; 32]>::try_from(sha256)
                .map_err(|_| format!("payload_sha256 has {} bytes, expected 32", sha256.len()))?;
            Ok(Some(PayloadCut { length, sha256 }))
        }
        (length, sha256) => Err(format!(
            "payload_length {length:?} and payload_sha256 {:?} are not both set or both null",
            sha256.map(<[u8]>::len)
        )),
    }
}

pub(crate) fn claim_record(t: StoredClaim) -> QueryResult<ClaimRecord> {
    let status = ClaimStatus::parse(&t.status).ok_or_else(|| {
        diesel::result::Error::DeserializationError(
            format!("unknown claim status {:?}", t.status).into(),
        )
    })?;
    Ok(ClaimRecord {
        group: t.consumer_group,
        key: t.message_key,
        message_type: t.message_type,
        tenant: t.tenant,
        status,
        attempts: t.attempts,
        starts: t.starts,
        next_attempt_at: t.next_attempt_at,
        last_error: t.last_error,
        has_payload: t.has_payload,
        first_seen_at: t.first_seen_at,
        updated_at: t.updated_at,
    })
}

/// The reason stored as `text` for the letters named by `what` ("dead letter 7"),
/// or a deserialization error naming them: a reason this version does not know (a
/// newer version wrote it) is never read as another one.
pub(crate) fn stored_reason(
    what: std::fmt::Arguments<'_>,
    text: &str,
) -> QueryResult<DeadLetterReason> {
    DeadLetterReason::parse(text).ok_or_else(|| {
        diesel::result::Error::DeserializationError(
            format!("{what}: unknown stored reason {text:?}").into(),
        )
    })
}

/// A stored dead letter, or a deserialization error naming the row and what of it
/// cannot be read (an unknown reason, headers that are not a JSON object of strings).
pub(crate) fn dead_letter(t: StoredDeadLetter) -> QueryResult<DeadLetter> {
    let unreadable = |problem: String| {
        diesel::result::Error::DeserializationError(
            format!("dead letter {}: {problem}", t.id).into(),
        )
    };
    let reason = stored_reason(format_args!("dead letter {}", t.id), &t.reason)?;
    let headers = serde_json::from_str(&t.headers).map_err(|err| {
        unreadable(format!(
            "headers {:?} are not a JSON object of strings: {err}",
            t.headers
        ))
    })?;
    Ok(DeadLetter {
        payload_cut: payload_cut(t.payload_length, t.payload_sha256.as_deref())
            .map_err(unreadable)?,
        id: t.id,
        group: t.consumer_group,
        key: t.message_key,
        message_type: t.message_type,
        tenant: t.tenant,
        payload: t.payload,
        headers,
        attempts: t.attempts,
        reason,
        last_error: t.last_error,
        dead_lettered_at: t.dead_lettered_at,
        replayed_at: t.replayed_at,
    })
}

/// A row to insert.
pub struct NewOutbox<'a> {
    pub key: &'a str,
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub message_type: &'a str,
    pub tenant: Option<&'a str>,
    pub payload: &'a [u8],
    pub headers: String,
    pub ordering_key: Option<&'a str>,
    pub created_at: DateTime<Utc>,
    pub available_at: DateTime<Utc>,
}

/// An outbox row as leasing reads it back, before its key and headers are checked.
#[derive(Queryable, QueryableByName, Selectable)]
#[diesel(table_name = outbox_messages)]
pub(crate) struct StoredOutbox {
    pub(crate) id: i64,
    pub(crate) message_key: String,
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) message_type: String,
    pub(crate) tenant: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) attempts: i32,
}

/// A stored row as a message, or why it cannot be one (it is recorded against the
/// row, never failing the lease).
fn outbox_row(t: StoredOutbox) -> std::result::Result<OutboxRow, UnreadableRow> {
    let unreadable = |error: String| UnreadableRow {
        id: t.id,
        attempts: t.attempts,
        error: format!("unreadable row: {error}"),
    };
    let message_key =
        MessageKey::new(t.message_key.clone()).map_err(|err| unreadable(err.to_string()))?;
    let headers = serde_json::from_str(&t.headers)
        .map_err(|err| unreadable(format!("headers are not a JSON object of strings: {err}")))?;
    Ok(OutboxRow {
        id: t.id,
        message: OutboxMessage {
            message_key,
            exchange: t.exchange,
            routing_key: t.routing_key,
            message_type: t.message_type,
            payload: t.payload,
            headers,
            tenant: t.tenant,
            ordering_key: t.ordering_key,
            // Consumed by leasing: a leased row is due, whenever it was first due.
            not_before: None,
        },
        attempts: t.attempts,
        created_at: t.created_at,
    })
}

/// Sorts decoded rows into readable rows and unreadable ones.
pub(crate) fn decode_into(
    t: StoredOutbox,
    rows: &mut Vec<OutboxRow>,
    unreadable: &mut Vec<UnreadableRow>,
) {
    match outbox_row(t) {
        Ok(row) => rows.push(row),
        Err(bad) => unreadable.push(bad),
    }
}

/// A dead outbox row, as an operator sees it: what was stored, read as text where
/// it can be (a row may be dead because it could not be read).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadOutboxRow {
    /// The row's id.
    pub id: i64,
    /// The message key, as stored.
    pub message_key: String,
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The message type.
    pub message_type: String,
    /// The ordering key.
    pub ordering_key: Option<String>,
    /// Failed publications.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// When its last attempt failed. (Its `created_at` is not read: a row may be
    /// dead because another producer wrote a timestamp the store cannot decode.)
    pub dead_at: DateTime<Utc>,
}

/// A dead outbox row as it is read back (`outbox_fates`: `dead_at` is past the 16
/// columns of `outbox_messages`).
#[derive(Queryable, Selectable)]
#[diesel(table_name = outbox_fates)]
pub(crate) struct StoredDeadOutbox {
    pub(crate) id: i64,
    pub(crate) message_key: String,
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) message_type: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
    pub(crate) dead_at: Option<DateTime<Utc>>,
}

pub(crate) fn dead_row(t: StoredDeadOutbox) -> DeadOutboxRow {
    DeadOutboxRow {
        id: t.id,
        message_key: t.message_key,
        exchange: t.exchange,
        routing_key: t.routing_key,
        message_type: t.message_type,
        ordering_key: t.ordering_key,
        attempts: t.attempts,
        last_error: t.last_error,
        // Selected with dead_at IS NOT NULL.
        dead_at: t.dead_at.unwrap_or(DateTime::<Utc>::MIN_UTC),
    }
}

/// What a retention purge deletes: each kind has its own table, timestamp and
/// index, and purges of different kinds never wait for each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PurgeTarget {
    /// Outbox rows published before the cutoff (by `published_at`).
    PublishedOutboxRows,
    /// `done` claims last changed before the cutoff (by `updated_at`).
    DoneClaims,
    /// Dead letters discarded before the cutoff (by `discarded_at`).
    DiscardedDeadLetters,
    /// Idempotency records created before the cutoff (by `created_at`) that are
    /// settled, or uncommitted with a lease that ended before the cutoff; a committed
    /// request not settled yet is kept. The feature `idempotency`'s
    /// `purge_expired_requests` runs this purge.
    ExpiredIdempotencyKeys,
}

/// What one bounded purge batch did (see [`purge_batch`](crate::purge_batch)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeBatch {
    /// Rows deleted.
    pub deleted: u64,
    /// The newest timestamp among the deleted rows: the next batch of the same purge
    /// starts there, so it never walks again over what this one deleted. `None`
    /// when nothing was deleted.
    pub resume_from: Option<DateTime<Utc>>,
    /// PostgreSQL: another purge of the same kind held the table's purge lock, so
    /// this batch deleted nothing and the other purge takes the rows. Always false
    /// on SQLite.
    pub busy: bool,
}
