//! The message contract of the credit ledger: exchange `jobs` (topic, durable; its name
//! takes `INBOX_PREFIX`), routing key equal to the AMQP `type`, `message_id` the message
//! key, JSON bodies.

use inbox_core::{MessageKey, OutboxMessage};
use serde::{Deserialize, Serialize};

/// The topic exchange every job message goes through.
pub const EXCHANGE: &str = "jobs";

/// `{"job_id": "...", "attempt": 1}`: run this attempt of the job.
pub const JOB_RUN: &str = "job.run";
/// `{"job_id": "...", "reason": "timeout", "transient": true}`: an attempt failed.
pub const JOB_FAILED: &str = "job.failed";
/// `{"job_id": "..."}`: the job's result exists and is delivered.
pub const JOB_SUCCEEDED: &str = "job.succeeded";
/// `{"job_id", "user_id", "cost", "attempts", "last_error"}`: the job used up its
/// attempts; kept for manual inspection, nothing consumes it.
pub const JOB_DEAD: &str = "job.dead";

/// The consumer group of the ledger (`job.failed`, `job.succeeded`).
pub const LEDGER_GROUP: &str = "credit.ledger";
/// The consumer group of the simulated job runner (`job.run`).
pub const RUNNER_GROUP: &str = "credit.runner";
/// The queue `job.dead` messages wait in for an operator (no consumer).
pub const DEAD_JOBS_QUEUE: &str = "credit.dead-jobs";

/// The namespace of every message key the example derives.
const KEY_NAMESPACE: &str = "credit";

/// The longest job id, user id or reason the contract accepts (bytes).
pub const MAX_TEXT: usize = 255;

fn check_text(what: &str, text: &str) -> Result<(), String> {
    if text.is_empty() || text.len() > MAX_TEXT {
        return Err(format!(
            "{what} must be 1 to {MAX_TEXT} bytes, found {}",
            text.len()
        ));
    }
    if text.contains('\0') {
        return Err(format!("{what} must not contain a NUL byte"));
    }
    Ok(())
}

/// `job.run`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawRun")]
pub struct JobRun {
    /// The job.
    pub job_id: String,
    /// The attempt to run, from 1.
    pub attempt: i32,
}

#[derive(Deserialize)]
struct RawRun {
    job_id: String,
    attempt: i32,
}

impl TryFrom<RawRun> for JobRun {
    type Error = String;
    fn try_from(raw: RawRun) -> Result<Self, String> {
        check_text("job_id", &raw.job_id)?;
        if raw.attempt < 1 {
            return Err(format!("attempt must be at least 1, found {}", raw.attempt));
        }
        Ok(Self {
            job_id: raw.job_id,
            attempt: raw.attempt,
        })
    }
}

/// `job.failed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawFailed")]
pub struct JobFailed {
    /// The job.
    pub job_id: String,
    /// Why (kept as the job's `last_error`).
    pub reason: String,
    /// Whether another attempt may succeed (retry) or not (the job fails).
    pub transient: bool,
    /// Optional: the attempt that failed. A signal naming an attempt that is no
    /// longer the job's current one still refunds (once), but decides no retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i32>,
}

#[derive(Deserialize)]
struct RawFailed {
    job_id: String,
    reason: String,
    transient: bool,
    #[serde(default)]
    attempt: Option<i32>,
}

impl TryFrom<RawFailed> for JobFailed {
    type Error = String;
    fn try_from(raw: RawFailed) -> Result<Self, String> {
        check_text("job_id", &raw.job_id)?;
        check_text("reason", &raw.reason)?;
        if let Some(attempt) = raw.attempt.filter(|a| *a < 1) {
            return Err(format!("attempt must be at least 1, found {attempt}"));
        }
        Ok(Self {
            job_id: raw.job_id,
            reason: raw.reason,
            transient: raw.transient,
            attempt: raw.attempt,
        })
    }
}

/// `job.succeeded`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawSucceeded")]
pub struct JobSucceeded {
    /// The job.
    pub job_id: String,
}

#[derive(Deserialize)]
struct RawSucceeded {
    job_id: String,
}

impl TryFrom<RawSucceeded> for JobSucceeded {
    type Error = String;
    fn try_from(raw: RawSucceeded) -> Result<Self, String> {
        check_text("job_id", &raw.job_id)?;
        Ok(Self { job_id: raw.job_id })
    }
}

/// `job.dead`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobDead {
    /// The job.
    pub job_id: String,
    /// Its user.
    pub user_id: String,
    /// The cost charged (and refunded).
    pub cost: i64,
    /// Attempts made.
    pub attempts: i32,
    /// The last failure's reason.
    pub last_error: String,
}

/// The outbox message of attempt `attempt` of `job_id`: one key per attempt, so a
/// retry enqueued twice is enqueued once.
pub fn run_message(exchange: &str, job_id: &str, attempt: i32) -> OutboxMessage {
    let body = JobRun {
        job_id: job_id.to_owned(),
        attempt,
    };
    OutboxMessage::new(
        MessageKey::derive(KEY_NAMESPACE, &format!("{job_id}:{attempt}"), JOB_RUN),
        exchange,
        JOB_RUN,
        serde_json::to_vec(&body).unwrap_or_default(),
    )
}

/// The outbox message announcing a dead job (one per job).
pub fn dead_message(exchange: &str, dead: &JobDead) -> OutboxMessage {
    OutboxMessage::new(
        MessageKey::derive(KEY_NAMESPACE, &dead.job_id, JOB_DEAD),
        exchange,
        JOB_DEAD,
        serde_json::to_vec(dead).unwrap_or_default(),
    )
}

/// A signal the simulated runner sends about attempt `attempt`; `which` tells apart
/// the several signals of one attempt (a timeout and a later error callback).
pub fn signal_message(
    exchange: &str,
    job_id: &str,
    attempt: i32,
    which: &str,
    message_type: &str,
    body: Vec<u8>,
) -> OutboxMessage {
    OutboxMessage::new(
        MessageKey::derive(
            KEY_NAMESPACE,
            &format!("{job_id}:{attempt}:{which}"),
            message_type,
        ),
        exchange,
        message_type,
        body,
    )
}

/// A new job id: a UUID from this process, the time and a counter.
pub fn new_job_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let seed = format!(
        "{}:{nanos}:{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    MessageKey::derive(KEY_NAMESPACE, &seed, "job")
        .as_str()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_decode_as_the_contract_says() {
        let failed: JobFailed =
            serde_json::from_str(r#"{"job_id": "j1", "reason": "timeout", "transient": true}"#)
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(failed.attempt, None);
        assert!(failed.transient);
        let ok: JobSucceeded = serde_json::from_str(r#"{"job_id": "j1", "extra": 1}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.job_id, "j1");
        for bad in [
            r#"{"job_id": "", "reason": "x", "transient": true}"#,
            r#"{"job_id": "j", "reason": "x"}"#,
            r#"{"job_id": "j", "reason": "x", "transient": "yes"}"#,
            r#"{"job_id": "j", "reason": "x", "transient": true, "attempt": 0}"#,
        ] {
            assert!(serde_json::from_str::<JobFailed>(bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<JobRun>(r#"{"job_id": "j", "attempt": 0}"#).is_err());
        assert!(serde_json::from_str::<JobSucceeded>(r#"{"job": "j"}"#).is_err());
    }

    #[test]
    fn keys_are_stable_per_attempt() {
        let a = run_message(EXCHANGE, "j1", 2);
        let b = run_message(EXCHANGE, "j1", 2);
        assert_eq!(a.message_key, b.message_key);
        assert_ne!(a.message_key, run_message(EXCHANGE, "j1", 3).message_key);
        assert_eq!(a.routing_key, JOB_RUN);
        assert_ne!(new_job_id(), new_job_id());
    }
}
