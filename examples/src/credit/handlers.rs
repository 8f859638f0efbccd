//! The inbox handlers: the ledger (`job.failed`, `job.succeeded`) and the simulated
//! job runner (`job.run`). Each runs inside the transaction that claims its message,
//! so a signal's effect, the retry it enqueues and its claim commit together.

use std::time::Duration;

use inbox_core::display::Escaped;
use inbox_core::{ConsumerGroup, Handler, HandlerError, MessageContext, RetryPolicy};
use inbox_diesel::{enqueue, StoreConnection};

use super::contract::{
    dead_message, run_message, signal_message, JobDead, JobFailed, JobRun, JobSucceeded,
    JOB_FAILED, JOB_RUN, JOB_SUCCEEDED, LEDGER_GROUP, RUNNER_GROUP,
};
use super::db::{CreditDb, JobState};
use super::runner::{Mix, Outcome};

/// How a handler's own failures (a database error) are retried by the inbox: not the
/// job's retries, which are [`Ledger::job_policy`].
fn handler_policy() -> RetryPolicy {
    RetryPolicy::new(6, Duration::from_millis(100), Duration::from_secs(5))
        .unwrap_or_else(|_| unreachable!("valid literal policy"))
}

fn group(name: &str) -> ConsumerGroup {
    ConsumerGroup::new(name).unwrap_or_else(|_| unreachable!("valid literal group name"))
}

/// What the ledger needs to know: where retries and dead jobs are published, and the
/// job's retry policy (attempts and capped exponential backoff).
#[derive(Clone, Debug)]
pub struct Ledger {
    /// The exchange messages are enqueued to (`jobs`, with the prefix).
    pub exchange: String,
    /// Attempts per job, and the delay before attempt n + 1 after attempt n failed
    /// (`delay_after(n)`), which becomes the `job.run` row's not-before time.
    pub job_policy: RetryPolicy,
}

impl Ledger {
    /// The handlers of consumer group `credit.ledger`.
    pub fn handlers(&self) -> (FailedHandler, SucceededHandler) {
        (
            FailedHandler {
                ledger: self.clone(),
                group: group(LEDGER_GROUP),
            },
            SucceededHandler {
                group: group(LEDGER_GROUP),
            },
        )
    }
}

/// `job.failed`: refund (once, never after delivery), then decide the attempt's fate
/// once: retry with backoff, or `failed`, or `dead` with `job.dead` enqueued.
pub struct FailedHandler {
    ledger: Ledger,
    group: ConsumerGroup,
}

/// `job.succeeded`: mark delivered, then reclaim the refund if there was one.
pub struct SucceededHandler {
    group: ConsumerGroup,
}

/// A signal for a job that does not exist: permanent (dead-lettered), and loud.
fn unknown_job(job_id: &str, ctx: &MessageContext<'_>) -> HandlerError {
    tracing::error!(
        job_id = %Escaped(job_id),
        key = %Escaped(ctx.message_key().as_str()),
        message_type = %Escaped(&ctx.envelope().message_type),
        "a signal for a job that does not exist; it is dead-lettered"
    );
    HandlerError::permanent(format!("no job {job_id:?}: a signal for an unknown job"))
}

impl<C: StoreConnection + CreditDb> Handler<C> for FailedHandler {
    type Message = JobFailed;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        JOB_FAILED
    }

    fn retry_policy(&self) -> RetryPolicy {
        handler_policy()
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: JobFailed,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        let now = ctx.now();
        let refunded = conn.refund(&msg.job_id, now)?;
        let max = i32::try_from(self.ledger.job_policy.max_attempts()).unwrap_or(i32::MAX);
        let fate = conn.fail_attempt(
            &msg.job_id,
            msg.transient,
            max,
            &msg.reason,
            msg.attempt,
            now,
        )?;
        let Some(fate) = fate else {
            if refunded.is_none() && !conn.job_exists(&msg.job_id)? {
                return Err(unknown_job(&msg.job_id, ctx));
            }
            return Ok(());
        };
        match JobState::parse(&fate.state) {
            Some(JobState::Queued) => {
                let failed = u32::try_from(fate.attempts - 1).unwrap_or(1);
                let delay = self.ledger.job_policy.delay_after(failed);
                let not_before = now + chrono::Duration::from_std(delay).unwrap_or_default();
                let retry = run_message(&self.ledger.exchange, &msg.job_id, fate.attempts)
                    .with_not_before(not_before);
                enqueue(conn, &retry, now)?;
            }
            Some(JobState::Dead) => {
                let dead = JobDead {
                    job_id: msg.job_id.clone(),
                    user_id: fate.user_id,
                    cost: fate.cost,
                    attempts: fate.attempts,
                    last_error: msg.reason.clone(),
                };
                enqueue(conn, &dead_message(&self.ledger.exchange, &dead), now)?;
                tracing::warn!(job_id = %Escaped(&msg.job_id), attempts = fate.attempts, reason = %Escaped(&msg.reason),
                    "job is dead after its last attempt; job.dead enqueued");
            }
            _ => {}
        }
        Ok(())
    }
}

impl<C: StoreConnection + CreditDb> Handler<C> for SucceededHandler {
    type Message = JobSucceeded;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        JOB_SUCCEEDED
    }

    fn retry_policy(&self) -> RetryPolicy {
        handler_policy()
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: JobSucceeded,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        let now = ctx.now();
        let delivered = conn.deliver(&msg.job_id, now)?;
        // Unconditional: the guard decides whether there is a refund to take back.
        conn.reclaim(&msg.job_id, now)?;
        if !delivered && !conn.job_exists(&msg.job_id)? {
            return Err(unknown_job(&msg.job_id, ctx));
        }
        Ok(())
    }
}

/// `job.run`: the simulated runner. Starts the attempt if the job waits for it (a
/// stale or repeated `job.run` starts nothing), then enqueues the attempt's signals
/// per the [`Mix`].
pub struct RunnerHandler {
    exchange: String,
    mix: Mix,
    group: ConsumerGroup,
}

impl RunnerHandler {
    /// A runner publishing its signals to `exchange`.
    pub fn new(exchange: impl Into<String>, mix: Mix) -> Self {
        Self {
            exchange: exchange.into(),
            mix,
            group: group(RUNNER_GROUP),
        }
    }
}

impl<C: StoreConnection + CreditDb> Handler<C> for RunnerHandler {
    type Message = JobRun;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        JOB_RUN
    }

    fn retry_policy(&self) -> RetryPolicy {
        handler_policy()
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: JobRun,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        let now = ctx.now();
        if conn.start(&msg.job_id, msg.attempt, now)?.is_none() {
            if !conn.job_exists(&msg.job_id)? {
                return Err(unknown_job(&msg.job_id, ctx));
            }
            return Ok(());
        }
        let failed = |reason: &str, transient: bool| JobFailed {
            job_id: msg.job_id.clone(),
            reason: reason.to_owned(),
            transient,
            attempt: Some(msg.attempt),
        };
        let succeeded = JobSucceeded {
            job_id: msg.job_id.clone(),
        };
        let mut signals: Vec<(&str, &str, Vec<u8>)> = Vec::new();
        match self.mix.outcome(&msg.job_id, msg.attempt) {
            Outcome::Succeed => signals.push(("succeeded", JOB_SUCCEEDED, json(&succeeded))),
            Outcome::Transient => signals.push((
                "failed",
                JOB_FAILED,
                json(&failed("dependency_unavailable", true)),
            )),
            Outcome::Permanent => {
                signals.push(("failed", JOB_FAILED, json(&failed("invalid_input", false))))
            }
            Outcome::TimeoutThenSucceed => {
                signals.push(("timeout", JOB_FAILED, json(&failed("timeout", true))));
                signals.push(("succeeded", JOB_SUCCEEDED, json(&succeeded)));
            }
            Outcome::TimeoutThenError => {
                signals.push(("timeout", JOB_FAILED, json(&failed("timeout", true))));
                signals.push((
                    "error_callback",
                    JOB_FAILED,
                    json(&failed("error_callback", true)),
                ));
            }
        }
        for (which, message_type, body) in signals {
            let message = signal_message(
                &self.exchange,
                &msg.job_id,
                msg.attempt,
                which,
                message_type,
                body,
            );
            enqueue(conn, &message, now)?;
        }
        Ok(())
    }
}

fn json<T: serde::Serialize>(body: &T) -> Vec<u8> {
    serde_json::to_vec(body).unwrap_or_default()
}
