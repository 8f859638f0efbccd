//! Dead letters the store writes outside a handler's failure: a key collision, a
//! delivery the store cannot write as it is (`malformed`), and a delivery the broker
//! gave up on (see [`inbox_core::InboxStore::dead_letter`]).
//!
//! A letter of a body the transport cut (over its `max_body_bytes`) stores the prefix
//! as `payload` and the whole body's `payload_length` and `payload_sha256`. Both are
//! written once, by the insert that creates the letter, and no writer updates them:
//! replay, discard and purge touch other columns or delete the row, so no two writers
//! race on them.

use chrono::{DateTime, Utc};
use inbox_core::display::Escaped;
use inbox_core::{
    ConsumerGroup, DeadLetterOutcome, DeadLetterReason, Decision, Envelope, PayloadCut,
};

use super::delivery::Delivery;
use super::metrics::record_metrics;
use crate::backend::StoreConnection;
use crate::rows::{ClaimRow, NewDeadLetter};
use crate::store::Inner;
use crate::{ClaimStatus, Error, Result};

/// The longest `last_error` kept.
const MAX_ERROR_LEN: usize = 4000;

/// What of a delivery the stores cannot hold: PostgreSQL's TEXT rejects the NUL byte
/// (the key cannot hold one: `MessageKey::new` refuses it).
pub(super) fn unstorable_field(env: &Envelope) -> Option<String> {
    if env.message_type.contains('\0') {
        return Some("the message type contains a NUL byte".to_owned());
    }
    if env.tenant.as_deref().is_some_and(|t| t.contains('\0')) {
        return Some("the tenant contains a NUL byte".to_owned());
    }
    None
}

/// A text the stores can hold: NUL bytes (and the backslash, so the escape is
/// unambiguous) escaped.
pub(super) fn escape_text(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains(['\0', '\\']) {
        text.replace('\\', "\\\\").replace('\0', "\\0").into()
    } else {
        text.into()
    }
}

pub(super) fn truncate(mut s: String) -> String {
    if s.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

pub(super) fn headers_json(env: &Envelope) -> String {
    serde_json::to_string(&env.headers).unwrap_or_else(|_| "{}".to_owned())
}

/// The dead-letter row of a delivery: the whole envelope, as delivered (a payload the
/// transport cut keeps the whole body's length and SHA-256 beside its prefix).
pub(super) fn dead_letter_row<'a>(
    group: &'a ConsumerGroup,
    env: &'a Envelope,
    attempts: i32,
    reason: DeadLetterReason,
    last_error: &'a str,
    now: DateTime<Utc>,
) -> NewDeadLetter<'a> {
    NewDeadLetter {
        group: group.as_str(),
        key: env.message_key.as_str(),
        message_type: &env.message_type,
        tenant: env.tenant.as_deref(),
        payload: &env.payload,
        headers: headers_json(env),
        attempts,
        reason: reason.as_str(),
        last_error: Some(last_error),
        now,
        payload_length: env.payload_cut.as_ref().map(cut_length),
        payload_sha256: env.payload_cut.as_ref().map(|c| &c.sha256[..]),
    }
}

/// A cut body's length as stored (a length past `i64::MAX` cannot be delivered).
fn cut_length(cut: &PayloadCut) -> i64 {
    i64::try_from(cut.length).unwrap_or(i64::MAX)
}

/// What [`mark_dead_or_explain`] found.
enum Marked {
    /// The claim is now dead (marked or inserted), with its attempts.
    Dead(i32),
    /// Another payload holds the key: the claim is left alone, the dead letter is
    /// still recorded.
    Collision,
    /// Nothing to dead-letter: the effect committed, or the message is dead already.
    Already(DeadLetterOutcome),
}

/// Marks a claim dead for a delivery the broker gave up on, deciding from what the
/// guarded write did, never from a read before it: under READ COMMITTED a read does
/// not wait for a worker's uncommitted `done` claim, while the write waits for it
/// and then leaves the committed row alone. A row the write left alone is read again
/// after that wait.
fn mark_dead_or_explain<C: StoreConnection>(
    conn: &mut C,
    group: &ConsumerGroup,
    row: &ClaimRow<'_>,
    detail: &str,
    now: DateTime<Utc>,
) -> Result<Marked> {
    // A row that changes between the write and the read (a replay, a purge) is tried
    // again; a few rounds settle it.
    for _ in 0..3 {
        if let Some(attempts) = C::mark_dead(conn, group, row, detail, now)? {
            return Ok(Marked::Dead(attempts));
        }
        let stored = C::lookup(conn, group, &[row.key])?;
        match stored.first() {
            Some(s) if s.collides(row.digest) => return Ok(Marked::Collision),
            Some(s) if s.status == ClaimStatus::Done.as_str() => {
                return Ok(Marked::Already(DeadLetterOutcome::AlreadyDone))
            }
            Some(s) if s.status == ClaimStatus::Dead.as_str() => {
                return Ok(Marked::Already(DeadLetterOutcome::AlreadyDead))
            }
            _ => {}
        }
    }
    Err(Error::Internal(
        "a claim kept changing under a broker dead letter",
    ))
}

impl<C: StoreConnection> Inner<C> {
    /// Dead-letters a newcomer whose payload differs from the claimed one; the stored
    /// claim is left untouched.
    pub(super) fn dead_letter_collision(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        d: &Delivery<'_, C>,
        now: DateTime<Utc>,
        against: &str,
    ) -> std::result::Result<(), diesel::result::Error> {
        let last_error = format!(
            "key collision: payload digest differs from {against} under key {}",
            d.env.message_key
        );
        tracing::error!(group = %group, key = %Escaped(d.env.message_key.as_str()), "{}", Escaped(&last_error));
        C::insert_dead_letter(
            conn,
            &dead_letter_row(
                group,
                d.env,
                0,
                DeadLetterReason::KeyCollision,
                &last_error,
                now,
            ),
        )
    }

    /// A dead letter for a delivery that never reached a handler (see
    /// [`inbox_core::InboxStore::dead_letter`]).
    pub(crate) fn dead_letter(
        &self,
        group: &ConsumerGroup,
        env: &Envelope,
        reason: DeadLetterReason,
        detail: &str,
    ) -> Result<DeadLetterOutcome> {
        // A delivery the store cannot write as it is (the transport read a NUL byte
        // into its type or tenant): escaped, or every try fails and it loops.
        if let Some(why) = unstorable_field(env) {
            return Ok(
                match self.dead_letter_malformed(group, env, &format!("{detail}; {why}"))? {
                    Decision::AlreadyDeadLettered => DeadLetterOutcome::AlreadyDead,
                    _ => DeadLetterOutcome::Recorded,
                },
            );
        }
        let now = self.now();
        let digest = env.payload_digest();
        let row = ClaimRow {
            key: env.message_key.as_str(),
            message_type: &env.message_type,
            tenant: env.tenant.as_deref(),
            digest: &digest,
            payload: &env.payload,
        };
        let detail = truncate(detail.to_owned());
        // What is known of the attempts: the broker's deliveries, or the claim's
        // handled failures, whichever is larger.
        let delivered = env
            .delivery_count
            .map_or(0, |n| i32::try_from(n).unwrap_or(i32::MAX));
        let mut conn = self.connection()?;
        let outcome = C::write_transaction(&mut conn, |conn| {
            let mut attempts = delivered;
            // A malformed delivery's key was made up by the transport: it has no claim.
            if reason != DeadLetterReason::Malformed {
                // Marked dead in the same transaction as the dead letter, so a later
                // copy is acked as already dead-lettered.
                match mark_dead_or_explain(conn, group, &row, &detail, now)? {
                    Marked::Dead(claimed) => attempts = attempts.max(claimed),
                    Marked::Collision => {}
                    Marked::Already(outcome) => return Ok(outcome),
                }
            }
            C::insert_dead_letter(
                conn,
                &dead_letter_row(group, env, attempts, reason, &detail, now),
            )?;
            Ok::<_, Error>(DeadLetterOutcome::Recorded)
        })?;
        if outcome == DeadLetterOutcome::Recorded {
            tracing::error!(group = %group, key = %Escaped(env.message_key.as_str()), %reason, detail = %Escaped(&detail), "delivery dead-lettered");
            metrics::counter!(inbox_core::metrics::DEAD_LETTERED_TOTAL, "group" => group.to_string(), "reason" => reason.as_str())
                .increment(1);
        }
        Ok(outcome)
    }

    /// A dead letter (`malformed`) for a delivery the store cannot write as it is:
    /// its type and tenant escaped, the raw values kept in headers
    /// (`inbox-raw-message-type`, `inbox-raw-tenant`; JSON keeps a NUL byte), the key
    /// and payload as delivered. No claim is written: there is none the delivery could
    /// take, and its batch-mates go on.
    pub(super) fn dead_letter_malformed(
        &self,
        group: &ConsumerGroup,
        env: &Envelope,
        why: &str,
    ) -> Result<Decision> {
        let mut headers: std::collections::BTreeMap<String, String> = env
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        headers.insert(
            "inbox-raw-message-type".to_owned(),
            env.message_type.clone(),
        );
        if let Some(tenant) = &env.tenant {
            headers.insert("inbox-raw-tenant".to_owned(), tenant.clone());
        }
        let message_type = escape_text(&env.message_type);
        let tenant = env.tenant.as_deref().map(escape_text);
        let last_error = truncate(escape_text(why).into_owned());
        let now = self.now();
        let row = NewDeadLetter {
            group: group.as_str(),
            key: env.message_key.as_str(),
            message_type: &message_type,
            tenant: tenant.as_deref(),
            payload: &env.payload,
            headers: serde_json::to_string(&headers).unwrap_or_else(|_| "{}".to_owned()),
            attempts: 0,
            reason: DeadLetterReason::Malformed.as_str(),
            last_error: Some(&last_error),
            now,
            payload_length: env.payload_cut.as_ref().map(cut_length),
            payload_sha256: env.payload_cut.as_ref().map(|c| &c.sha256[..]),
        };
        let mut conn = self.connection()?;
        // No claim makes this idempotent: a redelivery finds the letter it left.
        let recorded = C::write_transaction(&mut conn, |conn| {
            if C::has_dead_letter(conn, &row)? {
                return Ok(false);
            }
            C::insert_dead_letter(conn, &row).map(|()| true)
        })?;
        let decision = if recorded {
            tracing::error!(group = %group, key = %Escaped(env.message_key.as_str()), error = %Escaped(&last_error), "delivery dead-lettered as malformed");
            Decision::DeadLettered(DeadLetterReason::Malformed)
        } else {
            Decision::AlreadyDeadLettered
        };
        record_metrics(group, [&decision]);
        Ok(decision)
    }
}
