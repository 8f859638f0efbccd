//! The JSON documents of the operator's records: one definition of their field names,
//! shared by the `inbox` CLI's `--json` output and the web console's JSON pages. The
//! field names are a contract (the CLI's README lists them); a field is added, never
//! renamed or removed.
//!
//! Values are kept exactly (a payload, key or error is hostile input: escaping is the
//! printer's job, the CLI's and the console's).

use std::fmt::Write as _;

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{json, Value};

use super::{
    BulkReport, DeadLetterDetails, DeadLetterEntry, DiscardOutcome, FailureGroup, HaltedGroup,
    OperatorStats, ReplayOutcome,
};
use crate::ClaimRecord;

/// A time as RFC 3339 in UTC with microseconds (`2026-12-02T14:08:29.123456Z`), or null.
pub fn time(t: Option<DateTime<Utc>>) -> Value {
    t.map_or(Value::Null, |t| {
        Value::String(t.to_rfc3339_opts(SecondsFormat::Micros, true))
    })
}

/// A listed dead letter (`dead-letters list --json`, the console's `/letters`).
pub fn dead_letter(e: &DeadLetterEntry) -> Value {
    json!({
        "id": e.id,
        "consumer_group": e.consumer_group,
        "message_key": e.message_key,
        "message_type": e.message_type,
        "tenant": e.tenant,
        "reason": e.reason.as_str(),
        "attempts": e.attempts,
        "last_error": e.last_error,
        "dead_lettered_at": time(Some(e.dead_lettered_at)),
        "replay_count": e.replay_count,
        "replayed_at": time(e.replayed_at),
        "discarded_at": time(e.discarded_at),
        "failure_group": e.failure_group,
        "status": e.status.as_str(),
        "delivered_by_replay": e.delivered_by_replay,
    })
}

/// Lower-case hex digits.
fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A dead letter in full (`dead-letters show --json`, the console's `/letters/{id}`):
/// the listed fields, then `payload` (text, or null when not UTF-8), `payload_hex`,
/// `payload_cut`, `headers`, `traceparent`, the key's first and last failure, the
/// claim's status, `replayable` and `replay_refusal`.
pub fn dead_letter_details(d: &DeadLetterDetails) -> Value {
    let mut v = dead_letter(&d.entry);
    let text = std::str::from_utf8(&d.payload).ok();
    if let Value::Object(map) = &mut v {
        map.insert("payload".into(), json!(text));
        map.insert("payload_hex".into(), json!(hex(&d.payload)));
        map.insert(
            "payload_cut".into(),
            json!(d
                .payload_cut
                .map(|c| json!({"length": c.length, "sha256": hex(&c.sha256)}))),
        );
        map.insert("headers".into(), json!(d.headers));
        map.insert(
            "traceparent".into(),
            json!(d.headers.get(inbox_core::TRACEPARENT_HEADER)),
        );
        map.insert("first_failure_at".into(), time(Some(d.first_failure_at)));
        map.insert("last_failure_at".into(), time(Some(d.last_failure_at)));
        map.insert(
            "claim_status".into(),
            json!(d.claim_status.map(|s| s.as_str())),
        );
        map.insert("replayable".into(), json!(d.replay_refusal.is_none()));
        map.insert("replay_refusal".into(), json!(d.replay_refusal));
    }
    v
}

/// A failure group (`dead-letters groups --json`, the console's `/failures`).
pub fn failure_group(g: &FailureGroup) -> Value {
    json!({
        "fingerprint": g.fingerprint,
        "reason": g.reason.as_str(),
        "message_type": g.message_type,
        "kind": g.kind,
        "signature": g.signature,
        "count": g.count,
        "consumer_groups": g.consumer_groups,
        "first_seen": time(Some(g.first_seen)),
        "last_seen": time(Some(g.last_seen)),
        "replayable": g.replayable,
        "sample_error": g.sample_error,
    })
}

/// A claim (`claims show --json`, the console's `/claims`).
pub fn claim(c: &ClaimRecord) -> Value {
    json!({
        "consumer_group": c.group,
        "message_key": c.key,
        "message_type": c.message_type,
        "tenant": c.tenant,
        "status": c.status.as_str(),
        "attempts": c.attempts,
        "starts": c.starts,
        "next_attempt_at": time(c.next_attempt_at),
        "last_error": c.last_error,
        "has_payload": c.has_payload,
        "first_seen_at": time(Some(c.first_seen_at)),
        "updated_at": time(Some(c.updated_at)),
    })
}

/// The operator's stats (`stats --json`, the console's overview).
pub fn stats(s: &OperatorStats) -> Value {
    let groups: Vec<Value> = s
        .groups
        .iter()
        .map(|g| {
            json!({
                "consumer_group": g.consumer_group,
                "started": g.started,
                "done": g.done,
                "failed": g.failed,
                "dead": g.dead,
                "retries_due": g.retries_due,
                "retries_waiting": g.retries_waiting,
                "oldest_pending_retry": time(g.oldest_pending_retry),
                "oldest_unprocessed_at": time(g.oldest_unprocessed_at),
            })
        })
        .collect();
    let letters: Vec<Value> = s
        .dead_letters
        .iter()
        .map(
            |l| json!({ "consumer_group": l.consumer_group, "reason": l.reason.as_str(), "count": l.count }),
        )
        .collect();
    let halted: Vec<Value> = s.halted.iter().map(halted_group).collect();
    json!({
        "at": time(Some(s.at)),
        "groups": groups,
        "halted": halted,
        "dead_letters": letters,
        "outbox": {
            "backlog": s.outbox_backlog,
            "oldest_unpublished_age_seconds": s.oldest_unpublished_age.map(|d| d.as_secs_f64()),
            "dead": s.dead_outbox_rows,
        },
    })
}

/// A halted consumer group (`groups halted --json`, the console's `/halts`).
pub fn halted_group(h: &HaltedGroup) -> Value {
    json!({
        "consumer_group": h.consumer_group,
        "message_key": h.message_key,
        "detail": h.detail,
        "halted_at": time(Some(h.halted_at)),
    })
}

/// What a replay of one letter did (`dead-letters replay <id> --json`, the console's
/// replay): `{"id", "outcome"}` with `outcome` one of `replayed` (with `sequence` and
/// `outbox_id`), `refused` (with `reason` and `advice`), `claim_not_dead` (with
/// `claim_status`, or `"none"`), `discarded`, `not_found`.
pub fn replay_outcome(id: i64, outcome: &ReplayOutcome) -> Value {
    match outcome {
        ReplayOutcome::Replayed {
            sequence,
            outbox_id,
        } => {
            json!({ "id": id, "outcome": "replayed", "sequence": sequence, "outbox_id": outbox_id })
        }
        ReplayOutcome::Refused { reason, advice } => {
            json!({ "id": id, "outcome": "refused", "reason": reason.as_str(), "advice": advice })
        }
        ReplayOutcome::ClaimNotDead { status } => {
            json!({ "id": id, "outcome": "claim_not_dead", "claim_status": status.map_or("none", |s| s.as_str()) })
        }
        ReplayOutcome::Discarded => json!({ "id": id, "outcome": "discarded" }),
        _ => json!({ "id": id, "outcome": "not_found" }),
    }
}

/// What a discard of one letter did: `{"id", "outcome"}` with `outcome` one of
/// `discarded`, `already_discarded`, `not_found`.
pub fn discard_outcome(id: i64, outcome: DiscardOutcome) -> Value {
    let name = match outcome {
        DiscardOutcome::Discarded => "discarded",
        DiscardOutcome::AlreadyDiscarded => "already_discarded",
        _ => "not_found",
    };
    json!({ "id": id, "outcome": name })
}

/// What a bulk replay did: `{"matched", "replayed", "refused", "skipped"}`.
pub fn bulk_replay(report: &BulkReport) -> Value {
    json!({
        "matched": report.matched,
        "replayed": report.affected,
        "refused": report.refused,
        "skipped": report.skipped,
    })
}

/// What a bulk discard did: `{"matched", "discarded", "skipped"}`.
pub fn bulk_discard(report: &BulkReport) -> Value {
    json!({
        "matched": report.matched,
        "discarded": report.affected,
        "skipped": report.skipped,
    })
}

/// A dead outbox row (the console's `/outbox`): `id`, `message_key`, `exchange`,
/// `routing_key`, `message_type`, `ordering_key`, `attempts`, `last_error`, `dead_at`.
pub fn dead_outbox_row(r: &crate::DeadOutboxRow) -> Value {
    json!({
        "id": r.id,
        "message_key": r.message_key,
        "exchange": r.exchange,
        "routing_key": r.routing_key,
        "message_type": r.message_type,
        "ordering_key": r.ordering_key,
        "attempts": r.attempts,
        "last_error": r.last_error,
        "dead_at": time(Some(r.dead_at)),
    })
}

/// The overview (the console's `/`): `at`, `groups` (each `consumer_group`, `halted`,
/// `processed_last_hour`, `processed_last_day`, `dead_lettered_last_hour`,
/// `dead_lettered_last_day` as `{count, at_least}`, `retries_waiting`,
/// `retries_due`), `halted` (as [`halted_group`]), `outbox` (`backlog`,
/// `oldest_unpublished_age_seconds`, `dead`, as in [`stats`]) and `activity` (as the
/// `activity` of `stats --json`).
pub fn overview(o: &super::Overview) -> Value {
    let halted: Vec<Value> = o.halted.iter().map(halted_group).collect();
    json!({
        "at": time(Some(o.at)),
        "groups": serde_json::to_value(&o.groups).unwrap_or(Value::Null),
        "halted": halted,
        "outbox": {
            "backlog": o.outbox_backlog,
            "oldest_unpublished_age_seconds": o.oldest_unpublished_age_seconds,
            "dead": o.dead_outbox_rows,
        },
        "activity": serde_json::to_value(&o.activity).unwrap_or(Value::Null),
    })
}
