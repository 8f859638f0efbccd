//! The inbox state machine: one consumer group's batch in one transaction.
//!
//! 1. De-duplicate inside the batch.
//! 2. Claim in key order, digest and due time in the conflict condition.
//! 3. Look up keys not returned by the same claim key: collision, duplicate, dead,
//!    not yet due, or (no row at all) a phantom conflict.
//! 4. Run the owned messages' handlers after the claims: optimistically all at once,
//!    and if anything fails, again from the start with a savepoint per message, the
//!    failure recorded by the same claim key.
//! 5. Commit once; the transport acts on the decisions.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use inbox_core::{
    delta, ClaimInvariantViolated, ClaimKey, ConsumerGroup, DeadLetterOutcome, DeadLetterReason,
    Decision, DynHandler, Envelope, HandlerErrorKind, HandlerFailure, MessageContext, MessageKey,
    RetryPolicy,
};

use crate::backend::{is_retryable, StoreConnection};
use crate::ops::{ClaimRow, FailureUpdate, NewDeadLetter};
use crate::store::{ClaimStatus, Inner};
use crate::{Error, Result};

/// How long a delivery waits when its transaction kept deadlocking even alone.
const CONTENDED_RETRY: Duration = Duration::from_secs(1);

/// The longest `last_error` kept.
const MAX_ERROR_LEN: usize = 4000;

/// One delivery of the batch, with what the store needs to claim it.
struct Delivery<'a, C> {
    idx: usize,
    env: &'a Envelope,
    digest: [u8; 32],
    handler: Option<&'a Arc<dyn DynHandler<C>>>,
    /// `inbox.delivery`: group and key from the start, the attempt once the message
    /// is claimed, the outcome once decided; its handler runs inside it when alone.
    span: tracing::Span,
}

impl<C> Delivery<'_, C> {
    fn row(&self) -> ClaimRow<'_> {
        ClaimRow {
            key: self.env.message_key.as_str(),
            message_type: &self.env.message_type,
            tenant: self.env.tenant.as_deref(),
            digest: &self.digest,
            payload: &self.env.payload,
        }
    }

    fn key(&self) -> &str {
        self.env.message_key.as_str()
    }
}

/// Why a batch transaction did not commit.
enum TxError {
    /// Deadlock, serialization failure or SQLITE_BUSY: run the batch again.
    Retryable(diesel::result::Error),
    /// A handler failed in the optimistic run: run again with a savepoint each. When
    /// the failing delivery is known (by index), its failure is recorded as is
    /// instead of calling its handler a second time.
    Isolate(Option<(usize, HandlerFailure)>),
    /// Anything else: nothing committed, the transport acks nothing.
    Fatal(Error),
}

impl From<diesel::result::Error> for TxError {
    fn from(err: diesel::result::Error) -> Self {
        if is_retryable(&err) {
            Self::Retryable(err)
        } else {
            Self::Fatal(Error::Database(err))
        }
    }
}

impl From<Error> for TxError {
    fn from(err: Error) -> Self {
        match err {
            Error::Database(db) => db.into(),
            other => Self::Fatal(other),
        }
    }
}

/// A handler as the store holds it.
type SharedHandler<C> = Arc<dyn DynHandler<C>>;

/// One handler's share of an optimistic run: (delivery index, context) each.
type HandlerRun<'h, 'e, C> = (&'h Arc<dyn DynHandler<C>>, Vec<(usize, MessageContext<'e>)>);

/// The outcome of one handler call inside its savepoint.
enum SavepointError {
    Failed(HandlerFailure),
    Db(diesel::result::Error),
}

impl From<diesel::result::Error> for SavepointError {
    fn from(err: diesel::result::Error) -> Self {
        Self::Db(err)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Optimistic,
    Isolated,
}

fn depth<C: StoreConnection>(conn: &mut C) -> std::result::Result<u32, TxError> {
    let status = AnsiTransactionManager::transaction_manager_status_mut(conn);
    Ok(status
        .transaction_depth()
        .map_err(TxError::from)?
        .map_or(0, NonZeroU32::get))
}

/// Puts the connection back at `target` depth: a handler that panicked inside its own
/// nested transaction leaves diesel's manager one level deeper, and diesel does not
/// unwind that for us.
fn restore_depth<C: StoreConnection>(
    conn: &mut C,
    target: u32,
) -> std::result::Result<(), TxError> {
    loop {
        let found = depth(conn)?;
        if found <= target {
            return Ok(());
        }
        AnsiTransactionManager::rollback_transaction(conn)?;
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Whether a handler's failure is the database asking for the transaction again (a
/// deadlock inside the handler retries the batch; it is not the message's fault).
fn failure_is_retryable(failure: &HandlerFailure) -> bool {
    match failure {
        HandlerFailure::Handler(err) => err
            .downcast_ref::<diesel::result::Error>()
            .is_some_and(is_retryable),
        _ => false,
    }
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

fn headers_json(env: &Envelope) -> String {
    serde_json::to_string(&env.headers).unwrap_or_else(|_| "{}".to_owned())
}

/// The dead-letter row of a delivery: the whole envelope, as delivered.
fn dead_letter_row<'a>(
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
    }
}

/// A copy later in the batch with the same digest takes the first copy's decision.
fn copy_decision(first: &Decision) -> Decision {
    match first {
        Decision::Processed | Decision::Duplicate => Decision::Duplicate,
        Decision::DeadLettered(_) | Decision::AlreadyDeadLettered => Decision::AlreadyDeadLettered,
        other => other.clone(),
    }
}

/// Counts decisions by outcome once their transaction committed (or, for a decision
/// that writes nothing, once it is made): one increment per counter and call, not one
/// per delivery (each carries the group label, built once here). Counting inside the
/// transaction would count twice whatever an isolated rerun or a retry after a
/// deadlock decides again.
fn record_metrics<'a>(group: &ConsumerGroup, decisions: impl IntoIterator<Item = &'a Decision>) {
    let (mut processed, mut duplicates, mut retried) = (0u64, 0u64, 0u64);
    let (mut collisions, mut violations) = (0u64, 0u64);
    let mut dead: Vec<(DeadLetterReason, u64)> = Vec::new();
    for decision in decisions {
        match decision {
            Decision::Processed => processed += 1,
            Decision::Duplicate | Decision::AlreadyDeadLettered => duplicates += 1,
            Decision::RetryAfter(_) => retried += 1,
            Decision::DeadLettered(reason) => {
                if *reason == DeadLetterReason::KeyCollision {
                    collisions += 1;
                }
                match dead.iter_mut().find(|(r, _)| r == reason) {
                    Some((_, n)) => *n += 1,
                    None => dead.push((*reason, 1)),
                }
            }
            Decision::Stop(_) => violations += 1,
            _ => {}
        }
    }
    let group = group.to_string();
    for (name, n) in [
        ("inbox_processed_total", processed),
        ("inbox_duplicates_total", duplicates),
        ("inbox_retried_total", retried),
        ("inbox_key_collisions_total", collisions),
        ("inbox_phantom_conflicts_total", violations),
    ] {
        if n > 0 {
            metrics::counter!(name, "group" => group.clone()).increment(n);
        }
    }
    for (reason, n) in dead {
        metrics::counter!(
            "inbox_dead_lettered_total", "group" => group.clone(), "reason" => reason.as_str()
        )
        .increment(n);
    }
}

impl<C: StoreConnection> Inner<C> {
    pub(crate) fn process(
        &self,
        group: &ConsumerGroup,
        batch: &[Envelope],
    ) -> Result<Vec<Decision>> {
        let span = tracing::debug_span!("inbox.batch", group = %group, size = batch.len());
        let _entered = span.enter();

        let mut first_copy: HashMap<&MessageKey, usize> = HashMap::new();
        let mut copies = Vec::new();
        let mut fresh = Vec::new();
        let mut redelivered = Vec::new();
        // The handler of each message type, looked up once per batch.
        let mut by_type: Vec<(&str, Option<&SharedHandler<C>>)> = Vec::new();
        let spans: Vec<tracing::Span> = batch
            .iter()
            .map(|env| {
                tracing::debug_span!(
                    "inbox.delivery",
                    group = %group,
                    key = %env.message_key,
                    attempt = tracing::field::Empty,
                    outcome = tracing::field::Empty,
                )
            })
            .collect();
        for (idx, env) in batch.iter().enumerate() {
            let handler = match by_type.iter().find(|(t, _)| *t == env.message_type) {
                Some(&(_, handler)) => handler,
                None => {
                    let handler = self
                        .handlers
                        .get(&(group.clone(), env.message_type.clone()));
                    by_type.push((&env.message_type, handler));
                    handler
                }
            };
            let delivery = Delivery {
                idx,
                env,
                digest: env.payload_digest(),
                handler,
                span: spans[idx].clone(),
            };
            match first_copy.entry(&env.message_key) {
                // A multi-row upsert cannot touch a row twice: claim each key once.
                Entry::Occupied(first) => copies.push((delivery, *first.get())),
                Entry::Vacant(slot) => {
                    slot.insert(idx);
                    if env.redelivered {
                        redelivered.push(delivery);
                    } else {
                        fresh.push(delivery);
                    }
                }
            }
        }

        let mut decisions: Vec<Option<Decision>> = vec![None; batch.len()];
        if !fresh.is_empty() {
            for (idx, decision) in self.run_with_retries(group, &fresh)? {
                decisions[idx] = Some(decision);
            }
        }
        for delivery in &redelivered {
            let decision = self.run_redelivered(group, delivery)?;
            decisions[delivery.idx] = Some(decision);
        }

        let mut collisions = Vec::new();
        let mut copied = Vec::new();
        for (copy, first) in copies {
            if copy.digest == batch[first].payload_digest() {
                decisions[copy.idx] = decisions[first].as_ref().map(copy_decision);
                copied.extend(decisions[copy.idx].clone());
            } else {
                collisions.push(copy);
            }
        }
        record_metrics(group, &copied);
        if !collisions.is_empty() {
            let now = self.clock.now();
            let mut conn = self.pool.get()?;
            C::write_transaction(&mut conn, |conn| {
                for copy in &collisions {
                    self.dead_letter_collision(
                        conn,
                        group,
                        copy,
                        now,
                        "an earlier copy in the same batch",
                    )?;
                }
                Ok::<_, Error>(())
            })?;
            let collided = Decision::DeadLettered(DeadLetterReason::KeyCollision);
            record_metrics(group, std::iter::repeat_n(&collided, collisions.len()));
            for copy in &collisions {
                decisions[copy.idx] = Some(collided.clone());
            }
        }

        let decisions: Vec<Decision> = decisions
            .into_iter()
            .map(|d| {
                d.ok_or_else(|| Error::Config("a delivery was left without a decision".to_owned()))
            })
            .collect::<Result<_>>()?;
        for (span, decision) in spans.iter().zip(&decisions) {
            span.record("outcome", tracing::field::debug(decision));
        }
        Ok(decisions)
    }

    /// Runs a batch transaction, again after a deadlock (bounded), then split in halves.
    fn run_with_retries(
        &self,
        group: &ConsumerGroup,
        items: &[Delivery<'_, C>],
    ) -> Result<Vec<(usize, Decision)>> {
        let mut tries = 0;
        loop {
            let mut conn = self.pool.get()?;
            let err = match self.run_transaction(&mut conn, group, items) {
                Ok(decisions) => {
                    record_metrics(group, decisions.iter().map(|(_, d)| d));
                    return Ok(decisions);
                }
                Err(TxError::Fatal(err)) => return Err(err),
                Err(TxError::Retryable(err)) => err,
                Err(TxError::Isolate(_)) => {
                    return Err(Error::Config("isolation requested twice".to_owned()))
                }
            };
            drop(conn);
            tries += 1;
            metrics::counter!("inbox_batch_conflicts_total", "group" => group.to_string())
                .increment(1);
            tracing::warn!(group = %group, tries, error = %err, "batch transaction conflicted");
            if tries <= self.settings.transaction_retries {
                std::thread::sleep(Duration::from_millis(5 * u64::from(tries)));
                continue;
            }
            if items.len() > 1 {
                let (left, right) = items.split_at(items.len() / 2);
                let mut decisions = self.run_with_retries(group, left)?;
                decisions.extend(self.run_with_retries(group, right)?);
                return Ok(decisions);
            }
            // Alone and still conflicting: try later; it is not the message's fault,
            // so no attempt is counted.
            let decisions: Vec<(usize, Decision)> = items
                .iter()
                .map(|d| (d.idx, Decision::RetryAfter(CONTENDED_RETRY)))
                .collect();
            record_metrics(group, decisions.iter().map(|(_, d)| d));
            return Ok(decisions);
        }
    }

    fn run_transaction(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        items: &[Delivery<'_, C>],
    ) -> std::result::Result<Vec<(usize, Decision)>, TxError> {
        let started = Instant::now();
        let now = self.clock.now();
        let decisions = match self.attempt(conn, group, items, now, Mode::Optimistic, None) {
            Err(TxError::Isolate(known)) => {
                self.attempt(conn, group, items, now, Mode::Isolated, known)?
            }
            other => other?,
        };
        let left = depth(conn)?;
        if left != 0 {
            return Err(TxError::Fatal(Error::TransactionDepth {
                expected: 0,
                found: left,
            }));
        }
        metrics::histogram!("inbox_batch_commit_seconds", "group" => group.to_string())
            .record(started.elapsed().as_secs_f64());
        Ok(decisions)
    }

    fn attempt(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        items: &[Delivery<'_, C>],
        now: DateTime<Utc>,
        mode: Mode,
        known: Option<(usize, HandlerFailure)>,
    ) -> std::result::Result<Vec<(usize, Decision)>, TxError> {
        C::write_transaction(conn, |conn| {
            // Lock before claim: a projection rebuild holds the lock exclusively, so
            // live batches wait for it instead of double counting beside it.
            let mut locks: Vec<(i64, bool)> = items
                .iter()
                .filter_map(|d| d.handler.and_then(|h| h.lock()))
                .map(|l| (l.id(), l.is_exclusive()))
                .collect();
            // In id order, each once (exclusive if any handler wants it so), so that
            // batches never wait for each other's locks in opposite orders.
            locks.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            locks.dedup_by_key(|l| l.0);
            C::take_locks(conn, &locks)?;

            // Claims in key order, so concurrent batches lock rows in the same order.
            let mut sorted: Vec<&Delivery<'_, C>> = items.iter().collect();
            sorted.sort_by(|a, b| a.key().cmp(b.key()));
            let rows: Vec<ClaimRow<'_>> = sorted.iter().map(|d| d.row()).collect();
            let owned: HashMap<String, i32> =
                C::claim(conn, group, &rows, now)?.into_iter().collect();

            let missing: Vec<&str> = sorted
                .iter()
                .map(|d| d.key())
                .filter(|k| !owned.contains_key(*k))
                .collect();
            // A statement of its own, not a CTE of the claim: under READ COMMITTED it
            // takes a new snapshot, so it sees the row of a concurrent claimer that
            // committed while our insert waited on it. Inside the claim statement that
            // row would be invisible and look like a phantom conflict.
            let stored: HashMap<String, _> = if missing.is_empty() {
                HashMap::new()
            } else {
                C::lookup(conn, group, &missing)?
                    .into_iter()
                    .map(|s| (s.key.clone(), s))
                    .collect()
            };

            let mut decisions = Vec::with_capacity(items.len());
            let mut mine = Vec::with_capacity(owned.len());
            for d in sorted {
                if let Some(&attempts) = owned.get(d.key()) {
                    mine.push((d, attempts));
                    continue;
                }
                let decision = match stored.get(d.key()) {
                    None => phantom(
                        group,
                        &d.env.message_key,
                        "the claim insert conflicted but no row exists under the same claim key",
                    ),
                    Some(s) if s.digest != d.digest => {
                        self.dead_letter_collision(conn, group, d, now, "the claimed message")?;
                        Decision::DeadLettered(DeadLetterReason::KeyCollision)
                    }
                    Some(s) => match ClaimStatus::parse(&s.status) {
                        Some(ClaimStatus::Done) => Decision::Duplicate,
                        Some(ClaimStatus::Dead) => Decision::AlreadyDeadLettered,
                        Some(ClaimStatus::Failed | ClaimStatus::Started) => {
                            match s.next_attempt_at.map(|t| (t - now).to_std()) {
                                Some(Ok(wait)) if !wait.is_zero() => Decision::RetryAfter(wait),
                                _ => phantom(
                                    group,
                                    &d.env.message_key,
                                    "the claim insert conflicted with a row it should have taken over",
                                ),
                            }
                        }
                        None => phantom(
                            group,
                            &d.env.message_key,
                            &format!("unknown claim status {:?}", s.status),
                        ),
                    },
                };
                decisions.push((d.idx, decision));
            }

            // Handlers run only after every claim of the batch is taken.
            match mode {
                Mode::Optimistic => self.run_optimistic(conn, group, &mine, now, &mut decisions)?,
                Mode::Isolated => {
                    self.run_isolated(conn, group, &mine, now, known, &mut decisions)?
                }
            }
            Ok(decisions)
        })
    }

    /// Every owned message at once, no savepoints; any failure asks for isolation.
    fn run_optimistic(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        mine: &[(&Delivery<'_, C>, i32)],
        now: DateTime<Utc>,
        decisions: &mut Vec<(usize, Decision)>,
    ) -> std::result::Result<(), TxError> {
        let mut per_handler: Vec<HandlerRun<'_, '_, C>> = Vec::new();
        for (d, attempts) in mine {
            let attempt = attempt_number(*attempts);
            d.span.record("attempt", attempt);
            let Some(handler) = d.handler else {
                decisions.push((d.idx, self.fail(conn, group, d, *attempts, None, now)?));
                continue;
            };
            let ctx = MessageContext::new(d.env, group, attempt, now);
            match per_handler
                .iter_mut()
                .find(|(h, _)| Arc::ptr_eq(h, handler))
            {
                Some((_, ctxs)) => ctxs.push((d.idx, ctx)),
                None => per_handler.push((handler, vec![(d.idx, ctx)])),
            }
        }
        for (handler, entries) in per_handler {
            let ctxs: Vec<MessageContext<'_>> = entries.iter().map(|(_, c)| *c).collect();
            let before = depth(conn)?;
            let outcome = catch_unwind(AssertUnwindSafe(|| handler.handle_all(conn, &ctxs)));
            match outcome {
                Ok(Ok(())) => {
                    decisions.extend(entries.iter().map(|(idx, _)| (*idx, Decision::Processed)))
                }
                Ok(Err((at, failure))) => {
                    restore_depth(conn, before)?;
                    if failure_is_retryable(&failure) {
                        return Err(TxError::Retryable(retryable_cause(failure)));
                    }
                    let known = at
                        .and_then(|i| entries.get(i))
                        .map(|(idx, _)| (*idx, failure));
                    return Err(TxError::Isolate(known));
                }
                Err(_) => {
                    restore_depth(conn, before)?;
                    return Err(TxError::Isolate(None));
                }
            }
        }
        Ok(())
    }

    /// One savepoint per owned message; a failure rolls back to it and is recorded.
    fn run_isolated(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        mine: &[(&Delivery<'_, C>, i32)],
        now: DateTime<Utc>,
        mut known: Option<(usize, HandlerFailure)>,
        decisions: &mut Vec<(usize, Decision)>,
    ) -> std::result::Result<(), TxError> {
        for (d, attempts) in mine {
            let Some(handler) = d.handler else {
                decisions.push((d.idx, self.fail(conn, group, d, *attempts, None, now)?));
                continue;
            };
            // The optimistic run already saw this message fail: one attempt, one call.
            if known.as_ref().is_some_and(|(idx, _)| *idx == d.idx) {
                if let Some((_, failure)) = known.take() {
                    let decision = self.fail(conn, group, d, *attempts, Some(failure), now)?;
                    decisions.push((d.idx, decision));
                    continue;
                }
            }
            let attempt = attempt_number(*attempts);
            d.span.record("attempt", attempt);
            let ctx = MessageContext::new(d.env, group, attempt, now);
            let _entered = d.span.enter();
            let outcome = conn.transaction::<_, SavepointError, _>(|conn| {
                let before = depth(conn).map_err(|e| match e {
                    TxError::Retryable(db) => SavepointError::Db(db),
                    _ => SavepointError::Failed(HandlerFailure::Panic(
                        "broken transaction state".into(),
                    )),
                })?;
                let result = catch_unwind(AssertUnwindSafe(|| handler.handle_payload(conn, &ctx)));
                let failure = match result {
                    Ok(Ok(())) => return Ok(()),
                    Ok(Err(failure)) => failure,
                    Err(payload) => HandlerFailure::Panic(panic_message(&*payload)),
                };
                if restore_depth(conn, before).is_err() {
                    return Err(SavepointError::Db(
                        diesel::result::Error::BrokenTransactionManager,
                    ));
                }
                Err(SavepointError::Failed(failure))
            });
            let decision = match outcome {
                Ok(()) => Decision::Processed,
                Err(SavepointError::Db(err)) => return Err(err.into()),
                Err(SavepointError::Failed(failure)) => {
                    if failure_is_retryable(&failure) {
                        return Err(TxError::Retryable(retryable_cause(failure)));
                    }
                    // The savepoint is rolled back; the claim row is still ours.
                    self.fail(conn, group, d, *attempts, Some(failure), now)?
                }
            };
            decisions.push((d.idx, decision));
        }
        Ok(())
    }

    /// Records a failure by the same claim key the claim used; `None` means no
    /// handler takes the message type.
    fn fail(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        d: &Delivery<'_, C>,
        attempts_before: i32,
        failure: Option<HandlerFailure>,
        now: DateTime<Utc>,
    ) -> std::result::Result<Decision, TxError> {
        let policy = d
            .handler
            .map_or_else(RetryPolicy::default, |h| h.retry_policy());
        let attempts = attempts_before.saturating_add(1);
        let exhausted = policy.is_exhausted(u32::try_from(attempts).unwrap_or(u32::MAX));
        let (outcome, last_error) = match &failure {
            None => (
                Err(DeadLetterReason::NoHandler),
                format!(
                    "no handler in group {group} takes message type {:?}",
                    d.env.message_type
                ),
            ),
            Some(f @ HandlerFailure::Decode(_)) => {
                (Err(DeadLetterReason::DecodeError), f.to_string())
            }
            Some(f @ HandlerFailure::Handler(e)) => {
                let outcome = match e.kind() {
                    HandlerErrorKind::Permanent => Err(DeadLetterReason::Permanent),
                    _ if exhausted => Err(DeadLetterReason::MaxAttempts),
                    HandlerErrorKind::RetryAfter(delay) => Ok(delay),
                    _ => Ok(policy.delay_after(attempts.unsigned_abs())),
                };
                (outcome, f.to_string())
            }
            Some(f) => (
                if exhausted {
                    Err(DeadLetterReason::MaxAttempts)
                } else {
                    Ok(policy.delay_after(attempts.unsigned_abs()))
                },
                f.to_string(),
            ),
        };
        let last_error = truncate(last_error);
        // Record the delay the transport will really wait: its tier, not the policy's.
        let outcome = outcome.map(|delay| match &self.settings.ladder {
            Some(ladder) => ladder.tier_for(delay),
            None => delay,
        });
        let update = FailureUpdate {
            status: if outcome.is_ok() {
                ClaimStatus::Failed
            } else {
                ClaimStatus::Dead
            },
            next_attempt_at: outcome.as_ref().ok().map(|delay| now + delta(*delay)),
            last_error: &last_error,
            // Kept only while a retry is pending, so the message can be redriven.
            payload: outcome.is_ok().then_some(d.env.payload.as_slice()),
            now,
        };
        let key = ClaimKey::new(group.clone(), d.env.message_key.clone());
        // By the same claim key the claim used: exactly one row, or the claim vanished.
        let touched = C::record_failure(conn, &key, &update, true)?;
        if touched != [attempts] {
            return Ok(phantom(
                group,
                &d.env.message_key,
                &format!(
                    "the failure update by claim key returned attempts {touched:?}, expected [{attempts}]"
                ),
            ));
        }
        tracing::warn!(group = %group, key = %d.env.message_key, attempts, error = %last_error, "handler failed");
        match outcome {
            Ok(delay) => Ok(Decision::RetryAfter(delay)),
            Err(reason) => {
                C::insert_dead_letter(
                    conn,
                    &dead_letter_row(group, d.env, attempts, reason, &last_error, now),
                )?;
                tracing::error!(group = %group, key = %d.env.message_key, %reason, "message dead-lettered");
                Ok(Decision::DeadLettered(reason))
            }
        }
    }

    /// Dead-letters a newcomer whose payload differs from the claimed one; the stored
    /// claim is left untouched.
    fn dead_letter_collision(
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
        tracing::error!(group = %group, key = %d.env.message_key, "{last_error}");
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
        let now = self.clock.now();
        let digest = env.payload_digest();
        let row = ClaimRow {
            key: env.message_key.as_str(),
            message_type: &env.message_type,
            tenant: env.tenant.as_deref(),
            digest: &digest,
            payload: &env.payload,
        };
        let detail = truncate(detail.to_owned());
        let mut conn = self.pool.get()?;
        let outcome = C::write_transaction(&mut conn, |conn| {
            // A malformed delivery's key was made up by the transport: it has no claim.
            if reason != DeadLetterReason::Malformed {
                let stored = C::lookup(conn, group, &[row.key])?;
                match stored.first() {
                    Some(s) if s.digest == digest && s.status == ClaimStatus::Done.as_str() => {
                        return Ok(DeadLetterOutcome::AlreadyDone)
                    }
                    Some(s) if s.digest == digest && s.status == ClaimStatus::Dead.as_str() => {
                        return Ok(DeadLetterOutcome::AlreadyDead)
                    }
                    // Marked dead in the same transaction as the dead letter, so a later
                    // copy is acked as already dead-lettered.
                    _ => {
                        C::mark_dead(conn, group, &row, &detail, now)?;
                    }
                }
            }
            C::insert_dead_letter(conn, &dead_letter_row(group, env, 0, reason, &detail, now))?;
            Ok::<_, Error>(DeadLetterOutcome::Recorded)
        })?;
        if outcome == DeadLetterOutcome::Recorded {
            tracing::error!(group = %group, key = %env.message_key, %reason, detail, "delivery dead-lettered");
            metrics::counter!("inbox_dead_lettered_total", "group" => group.to_string(), "reason" => reason.as_str())
                .increment(1);
        }
        Ok(outcome)
    }

    /// A redelivered message: one at a time per group in this process, first a
    /// committed start mark (under the claim's own conflict condition), then the
    /// normal path. Too many unfinished starts dead-letter it as a crash loop.
    fn run_redelivered(&self, group: &ConsumerGroup, d: &Delivery<'_, C>) -> Result<Decision> {
        let slot = self.slot(group);
        let _one_at_a_time = slot.lock().unwrap_or_else(PoisonError::into_inner);
        let mut tries = 0;
        let crashed = loop {
            let now = self.clock.now();
            let mut conn = self.pool.get()?;
            let marked = C::write_transaction(&mut conn, |conn| {
                let Some(starts) = C::mark_start(conn, group, &d.row(), now)? else {
                    return Ok(None);
                };
                let limit = i32::try_from(self.settings.crash_limit).unwrap_or(i32::MAX);
                if starts <= limit {
                    return Ok(None);
                }
                let unfinished = starts - 1;
                let last_error =
                    format!("crash loop: {unfinished} starts without an outcome (limit {limit})");
                let update = FailureUpdate {
                    status: ClaimStatus::Dead,
                    next_attempt_at: None,
                    last_error: &last_error,
                    payload: None,
                    now,
                };
                let key = ClaimKey::new(group.clone(), d.env.message_key.clone());
                let touched = C::record_failure(conn, &key, &update, false)?;
                let [attempts] = touched[..] else {
                    return Ok(Some(phantom(
                        group,
                        &d.env.message_key,
                        &format!(
                            "the crash-loop update by claim key touched {} rows",
                            touched.len()
                        ),
                    )));
                };
                C::insert_dead_letter(
                    conn,
                    &dead_letter_row(
                        group,
                        d.env,
                        attempts,
                        DeadLetterReason::CrashLoop,
                        &last_error,
                        now,
                    ),
                )?;
                tracing::error!(group = %group, key = %d.env.message_key, unfinished, "crash loop: dead-lettered");
                Ok::<_, TxError>(Some(Decision::DeadLettered(DeadLetterReason::CrashLoop)))
            });
            match marked {
                Ok(decision) => break decision,
                Err(TxError::Retryable(err)) if tries < self.settings.transaction_retries => {
                    tries += 1;
                    tracing::warn!(group = %group, error = %err, "start mark conflicted");
                }
                Err(TxError::Retryable(_)) => {
                    let decision = Decision::RetryAfter(CONTENDED_RETRY);
                    record_metrics(group, [&decision]);
                    return Ok(decision);
                }
                Err(TxError::Fatal(err)) => return Err(err),
                Err(TxError::Isolate(_)) => {
                    return Err(Error::Config(
                        "isolation requested by a start mark".to_owned(),
                    ))
                }
            }
        };
        match crashed {
            Some(decision) => {
                record_metrics(group, [&decision]);
                Ok(decision)
            }
            None => {
                let mut decisions = self.run_with_retries(group, std::slice::from_ref(d))?;
                decisions
                    .pop()
                    .map(|(_, decision)| decision)
                    .ok_or_else(|| {
                        Error::Config("a delivery was left without a decision".to_owned())
                    })
            }
        }
    }
}

fn attempt_number(attempts_before: i32) -> u32 {
    attempts_before.unsigned_abs().saturating_add(1)
}

fn retryable_cause(failure: HandlerFailure) -> diesel::result::Error {
    match failure {
        HandlerFailure::Handler(err) => match err.downcast_ref::<diesel::result::Error>() {
            Some(diesel::result::Error::DatabaseError(kind, info)) => {
                diesel::result::Error::DatabaseError(*kind, Box::new(info.message().to_owned()))
            }
            _ => diesel::result::Error::RollbackTransaction,
        },
        _ => diesel::result::Error::RollbackTransaction,
    }
}

/// The claim table rejected or lost a claim its lookup cannot explain: halt the group,
/// loudly. Acking it as a duplicate would drop the message's effect silently.
fn phantom(group: &ConsumerGroup, key: &MessageKey, detail: &str) -> Decision {
    tracing::error!(group = %group, key = %key, detail, "claim invariant violated: stopping the consumer group");
    Decision::Stop(ClaimInvariantViolated {
        group: group.clone(),
        key: key.clone(),
        detail: detail.to_owned(),
    })
}
