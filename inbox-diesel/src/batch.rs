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

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use inbox_core::{
    delta, ClaimInvariantViolated, ClaimKey, ConsumerGroup, DeadLetterOutcome, DeadLetterReason,
    Decision, DynHandler, Envelope, HandlerError, HandlerErrorKind, HandlerFailure, MessageContext,
    MessageKey, RetryPolicy, MAX_RETRY_DELAY,
};

use crate::backend::{classify, is_retryable, ErrorClass, StoreConnection};
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
    /// One of the store's own statements failed on a delivery's data (a data
    /// exception, SQLSTATE class 22): split the batch until the delivery is alone.
    Data(diesel::result::Error),
    /// A handler ended or restarted the store's transaction itself (named): what it
    /// committed cannot be isolated any more.
    Ended(String),
    /// Anything else: nothing committed, the transport acks nothing.
    Fatal(Error),
}

impl From<diesel::result::Error> for TxError {
    fn from(err: diesel::result::Error) -> Self {
        match classify(&err) {
            ErrorClass::Contention => Self::Retryable(err),
            ErrorClass::Data => Self::Data(err),
            // On the store's own statements a constraint error is the schema's fault
            // (a unique index the store did not verify, say), never a delivery's: fail
            // loudly and ack nothing rather than dead-letter innocent messages.
            ErrorClass::Integrity | ErrorClass::Infrastructure | ErrorClass::Other => {
                Self::Fatal(Error::Database(err))
            }
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

/// A handler returned `Ok` although a statement of its own had failed: PostgreSQL
/// aborted the transaction, and a `COMMIT` would silently have rolled everything back.
#[derive(Debug, thiserror::Error)]
#[error("the handler returned Ok after a database error it did not propagate (the transaction was aborted)")]
struct SwallowedDatabaseError(#[source] diesel::result::Error);

/// What the store finds of its transaction after a handler call.
enum TxCheck {
    /// Still its own, and usable.
    Ours,
    /// Aborted by an error the handler swallowed.
    Aborted(diesel::result::Error),
    /// Ended or restarted by the handler.
    Replaced,
}

/// The savepoint an optimistic run's handlers start from (PostgreSQL).
const HANDLERS_SAVEPOINT: &str = "SAVEPOINT inbox_handlers";

/// Whose the transaction is after a handler call failed.
enum Ownership {
    /// The store's, and usable as it was.
    Usable,
    /// The store's, aborted by an error (a swallowed one, or the failing call's own);
    /// usable again after the rollback to the handlers' savepoint.
    WasAborted,
    /// Ended or restarted by the handler.
    Replaced,
}

/// After a failed handler call: an aborted transaction is rolled back to the handlers'
/// savepoint, which exists only in the store's own transaction; a rollback that fails
/// means the handler replaced it (an aborted state hides the transaction id).
fn ownership_after_failure<C: StoreConnection>(
    conn: &mut C,
    token: Option<&str>,
) -> std::result::Result<Ownership, TxError> {
    match check_transaction(conn, token)? {
        TxCheck::Ours => Ok(Ownership::Usable),
        TxCheck::Replaced => Ok(Ownership::Replaced),
        TxCheck::Aborted(_) => match conn.batch_execute("ROLLBACK TO SAVEPOINT inbox_handlers") {
            Ok(()) => match check_transaction(conn, token)? {
                TxCheck::Ours => Ok(Ownership::WasAborted),
                _ => Ok(Ownership::Replaced),
            },
            Err(err) if classify(&err) == ErrorClass::Infrastructure => Err(err.into()),
            Err(_) => Ok(Ownership::Replaced),
        },
    }
}

thread_local! {
    /// Whether a handler call on this thread outlived the batch deadline since the
    /// flag was last taken (a hang, which the server ended: counted like a crash).
    static HUNG: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Checks, after a handler call, that the transaction is still usable and still the
/// store's own: before the store decides, never after a `COMMIT` that PostgreSQL
/// turned into a rollback.
fn check_transaction<C: StoreConnection>(
    conn: &mut C,
    token: Option<&str>,
) -> std::result::Result<TxCheck, TxError> {
    let Some(token) = token else {
        return Ok(TxCheck::Ours);
    };
    match C::transaction_token(conn) {
        Ok(Some(now)) if now == token => Ok(TxCheck::Ours),
        Ok(_) => Ok(TxCheck::Replaced),
        Err(err) if classify(&err) == ErrorClass::Infrastructure => Err(err.into()),
        Err(err) => Ok(TxCheck::Aborted(err)),
    }
}

/// A handler as the store holds it.
type SharedHandler<C> = Arc<dyn DynHandler<C>>;

/// One handler's share of an optimistic run: (delivery index, context) each.
type HandlerRun<'h, 'e, C> = (&'h Arc<dyn DynHandler<C>>, Vec<(usize, MessageContext<'e>)>);

/// What a batch's handler run works on: the owned deliveries (with the attempts
/// before this one), the batch's `now`, and the transaction's token.
struct Run<'r, 'd, 'e, C> {
    group: &'r ConsumerGroup,
    mine: &'r [(&'d Delivery<'e, C>, i32)],
    now: DateTime<Utc>,
    token: Option<&'r str>,
    /// Set when a handler ended the transaction: the rollbacks that follow can fail
    /// and replace the error, so the finding is kept here.
    ended: &'r std::cell::Cell<Option<String>>,
}

impl<C: 'static> Run<'_, '_, '_, C> {
    fn ended_by(&self, handler: &dyn DynHandler<C>) -> TxError {
        let name = handler_name(handler);
        self.ended.set(Some(name.clone()));
        TxError::Ended(name)
    }
}

/// A handler's name for an error line: its group and message type.
fn handler_name<C: 'static>(handler: &dyn DynHandler<C>) -> String {
    format!("{}/{}", handler.group(), handler.message_type())
}

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
    /// A savepoint per message; with `count_contention`, contention raised inside a
    /// handler is recorded as its failure instead of rerunning the batch.
    Isolated {
        count_contention: bool,
    },
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

/// Whether a handler's failure is a data error the database raised (SQLSTATE classes
/// 22 and 23): permanent.
fn failure_is_data_error(err: &HandlerError) -> bool {
    err.downcast_ref::<diesel::result::Error>()
        .is_some_and(|db| matches!(classify(db), ErrorClass::Data | ErrorClass::Integrity))
}

/// What of a delivery the stores cannot hold: PostgreSQL's TEXT rejects the NUL byte
/// (the key cannot hold one: `MessageKey::new` refuses it).
fn unstorable_field(env: &Envelope) -> Option<String> {
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
fn escape_text(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains(['\0', '\\']) {
        text.replace('\\', "\\\\").replace('\0', "\\0").into()
    } else {
        text.into()
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

        let spans: Vec<tracing::Span> = batch
            .iter()
            .map(|env| {
                let span = tracing::debug_span!(
                    "inbox.delivery",
                    group = %group,
                    key = %env.message_key,
                    attempt = tracing::field::Empty,
                    outcome = tracing::field::Empty,
                    traceparent = tracing::field::Empty,
                );
                // The producer's trace is the delivery's parent (before it is entered).
                inbox_core::adopt_trace_parent(&span, env);
                span
            })
            .collect();
        // The handler of each message type, looked up once per batch.
        let mut by_type: Vec<(&str, Option<&SharedHandler<C>>)> = Vec::new();
        let mut pending = Vec::with_capacity(batch.len());
        let mut unstorable = Vec::new();
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
            match unstorable_field(env) {
                Some(why) => unstorable.push((delivery, why)),
                None => pending.push(delivery),
            }
        }

        let mut decisions: Vec<Option<Decision>> = vec![None; batch.len()];
        for (d, why) in &unstorable {
            decisions[d.idx] = Some(self.dead_letter_malformed(group, d.env, why)?);
        }
        // Rounds: each key once per round (a multi-row upsert cannot touch a row
        // twice). A later copy with the owner's digest takes the owner's decision; one
        // with another digest waits for the next round, where it is judged against the
        // stored claim like any delivery, so an impostor that comes first never takes
        // the real retry down with it.
        while !pending.is_empty() {
            let mut owner_of: HashMap<&MessageKey, usize> = HashMap::new();
            let mut owners = Vec::new();
            let mut copies = Vec::new();
            let mut later = Vec::new();
            for d in pending {
                match owner_of.get(&d.env.message_key) {
                    None => {
                        owner_of.insert(&d.env.message_key, owners.len());
                        owners.push(d);
                    }
                    Some(&o) if owners[o].digest == d.digest => copies.push((d, owners[o].idx)),
                    Some(_) => later.push(d),
                }
            }
            self.run_round(group, &owners, &mut decisions)?;
            let copied: Vec<Decision> = copies
                .iter()
                .filter_map(|(copy, owner)| {
                    let decision = decisions[*owner].as_ref().map(copy_decision);
                    decisions[copy.idx].clone_from(&decision);
                    decision
                })
                .collect();
            record_metrics(group, &copied);
            pending = later;
        }

        let decisions: Vec<Decision> = decisions
            .into_iter()
            .map(|d| d.ok_or(Error::Internal("a delivery was left without a decision")))
            .collect::<Result<_>>()?;
        for (span, decision) in spans.iter().zip(&decisions) {
            span.record("outcome", tracing::field::debug(decision));
        }
        Ok(decisions)
    }

    /// One round: deliveries with distinct keys. First deliveries go together;
    /// redeliveries one at a time through the crash-loop slot.
    fn run_round(
        &self,
        group: &ConsumerGroup,
        owners: &[Delivery<'_, C>],
        decisions: &mut [Option<Decision>],
    ) -> Result<()> {
        let (redelivered, fresh): (Vec<&Delivery<'_, C>>, Vec<&Delivery<'_, C>>) =
            owners.iter().partition(|d| d.env.redelivered);
        if !fresh.is_empty() {
            for (idx, decision) in self.run_with_retries(group, &fresh)? {
                decisions[idx] = Some(decision);
            }
        }
        for delivery in redelivered {
            decisions[delivery.idx] = Some(self.run_redelivered(group, delivery)?);
        }
        Ok(())
    }

    /// Runs a batch transaction; after contention again (bounded), then split in
    /// halves; a delivery alone whose free reruns are spent runs once more with a
    /// contention error inside its handler counted as an attempt. A data error on the
    /// store's own statements splits the batch until the delivery is alone, which is
    /// then dead-lettered as `malformed`: no single delivery fails its batch forever.
    fn run_with_retries(
        &self,
        group: &ConsumerGroup,
        items: &[&Delivery<'_, C>],
    ) -> Result<Vec<(usize, Decision)>> {
        let mut tries = 0;
        let mut count_contention = false;
        loop {
            let mut conn = self.pool.get()?;
            let outcome = self.run_transaction(&mut conn, group, items, count_contention);
            drop(conn);
            let err = match outcome {
                Ok(decisions) => {
                    record_metrics(group, decisions.iter().map(|(_, d)| d));
                    return Ok(decisions);
                }
                Err(TxError::Fatal(err)) => return Err(err),
                Err(TxError::Retryable(err)) => err,
                Err(TxError::Data(err)) => return self.split_on_data_error(group, items, &err),
                Err(TxError::Ended(handler)) => {
                    let detail = format!(
                        "handler {handler} ended or restarted the store's transaction itself (or \
                         moved its session's search_path); claims and effects of its batch may \
                         have committed without their decisions"
                    );
                    let decisions: Vec<(usize, Decision)> = items
                        .iter()
                        .map(|d| (d.idx, phantom(group, &d.env.message_key, &detail)))
                        .collect();
                    record_metrics(group, decisions.iter().map(|(_, d)| d));
                    return Ok(decisions);
                }
                Err(TxError::Isolate(_)) => {
                    return Err(Error::Internal("isolation requested by an isolated run"))
                }
            };
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
            if !count_contention {
                // Alone, free reruns spent: once more, and this time contention raised
                // inside the handler is its failure (an attempt), so a message that
                // always conflicts climbs the retry ladder instead of looping forever.
                count_contention = true;
                continue;
            }
            // Still conflicting on the store's own statements: not the message's
            // fault, so no attempt is counted.
            let decisions: Vec<(usize, Decision)> = items
                .iter()
                .map(|d| (d.idx, Decision::RetryAfter(CONTENDED_RETRY)))
                .collect();
            record_metrics(group, decisions.iter().map(|(_, d)| d));
            return Ok(decisions);
        }
    }

    /// A data error on the store's own statements: halves until the delivery is
    /// alone, then its dead letter (`malformed`), with what could not be stored kept.
    fn split_on_data_error(
        &self,
        group: &ConsumerGroup,
        items: &[&Delivery<'_, C>],
        err: &diesel::result::Error,
    ) -> Result<Vec<(usize, Decision)>> {
        match items {
            [d] => {
                let why = format!("the store could not write the delivery: {err}");
                Ok(vec![(
                    d.idx,
                    self.dead_letter_malformed(group, d.env, &why)?,
                )])
            }
            _ => {
                tracing::warn!(group = %group, size = items.len(), error = %err, "a delivery's data failed its batch: splitting");
                let (left, right) = items.split_at(items.len() / 2);
                let mut decisions = self.run_with_retries(group, left)?;
                decisions.extend(self.run_with_retries(group, right)?);
                Ok(decisions)
            }
        }
    }

    fn run_transaction(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        items: &[&Delivery<'_, C>],
        count_contention: bool,
    ) -> std::result::Result<Vec<(usize, Decision)>, TxError> {
        let started = Instant::now();
        let now = self.clock.now();
        // Counting contention needs a savepoint per message (a deadlock aborts the
        // transaction), so that run is isolated from the start.
        let first = if count_contention {
            Mode::Isolated { count_contention }
        } else {
            Mode::Optimistic
        };
        let ended = std::cell::Cell::new(None);
        let outcome = match self.attempt(conn, group, items, now, first, None, &ended) {
            Err(TxError::Isolate(known)) => self.attempt(
                conn,
                group,
                items,
                now,
                Mode::Isolated {
                    count_contention: false,
                },
                known,
                &ended,
            ),
            other => other,
        };
        if let Some(handler) = ended.take() {
            // The connection goes back to the pool: as the store set it up, not as the
            // handler left it.
            C::reset_session(conn)
                .and_then(|()| C::on_acquire(conn, self.schema.as_deref()))
                .and_then(|()| {
                    C::set_timeouts(
                        conn,
                        self.settings.statement_timeout,
                        self.settings.batch_deadline,
                    )
                })?;
            return Err(TxError::Ended(handler));
        }
        let decisions = outcome?;
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

    // The batch's context travels as arguments until the state machine is split into
    // its steps (one home per rule).
    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        items: &[&Delivery<'_, C>],
        now: DateTime<Utc>,
        mode: Mode,
        known: Option<(usize, HandlerFailure)>,
        ended: &std::cell::Cell<Option<String>>,
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
            let mut sorted: Vec<&Delivery<'_, C>> = items.to_vec();
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

            // Handlers run only after every claim of the batch is taken. The token
            // is read once here and again after each handler call.
            let token = if mine.iter().any(|(d, _)| d.handler.is_some()) {
                C::transaction_token(conn)?
            } else {
                None
            };
            let run = Run {
                group,
                mine: &mine,
                now,
                token: token.as_deref(),
                ended,
            };
            match mode {
                Mode::Optimistic => self.run_optimistic(conn, &run, &mut decisions)?,
                Mode::Isolated { count_contention } => {
                    self.run_isolated(conn, &run, known, count_contention, &mut decisions)?
                }
            }
            Ok(decisions)
        })
    }

    /// Every owned message at once, no savepoints; any failure asks for isolation.
    fn run_optimistic(
        &self,
        conn: &mut C,
        run: &Run<'_, '_, '_, C>,
        decisions: &mut Vec<(usize, Decision)>,
    ) -> std::result::Result<(), TxError> {
        let (group, now) = (run.group, run.now);
        let mut per_handler: Vec<HandlerRun<'_, '_, C>> = Vec::new();
        for (d, attempts) in run.mine {
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
        // Only the store's own transaction has this savepoint: after a failure that
        // left the transaction aborted, rolling back to it tells a swallowed error
        // (ours again, usable) from a handler that ended or restarted it.
        if run.token.is_some() && !per_handler.is_empty() {
            conn.batch_execute(HANDLERS_SAVEPOINT)?;
        }
        for (handler, entries) in per_handler {
            let ctxs: Vec<MessageContext<'_>> = entries.iter().map(|(_, c)| *c).collect();
            let before = depth(conn)?;
            let called = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| handler.handle_all(conn, &ctxs)));
            self.note_if_hung(called);
            let (failure, at) = match outcome {
                Ok(Ok(())) => match check_transaction(conn, run.token)? {
                    TxCheck::Ours => {
                        decisions
                            .extend(entries.iter().map(|(idx, _)| (*idx, Decision::Processed)));
                        continue;
                    }
                    TxCheck::Replaced => return Err(run.ended_by(&**handler)),
                    // A call swallowed an error; which one shows in isolation.
                    TxCheck::Aborted(_) => (None, None),
                },
                Ok(Err((at, failure))) => (Some(failure), at),
                Err(_) => (None, None),
            };
            if let Err(err) = restore_depth(conn, before) {
                return Err(match check_transaction(conn, run.token) {
                    Ok(TxCheck::Ours) => err,
                    Ok(_) => run.ended_by(&**handler),
                    // The connection itself is gone (the server ended a hung session).
                    Err(lost) => lost,
                });
            }
            // The failing call is to blame only if the transaction was still usable:
            // once an earlier call swallowed an error (PostgreSQL aborted the
            // transaction), the next call's first statement fails for it.
            let usable = match ownership_after_failure(conn, run.token)? {
                Ownership::Usable => true,
                Ownership::WasAborted => false,
                Ownership::Replaced => return Err(run.ended_by(&**handler)),
            };
            if let Some(failure) = failure {
                if failure_is_retryable(&failure) {
                    return Err(TxError::Retryable(retryable_cause(failure)));
                }
                let known = at
                    .filter(|_| usable)
                    .and_then(|i| entries.get(i))
                    .map(|(idx, _)| (*idx, failure));
                return Err(TxError::Isolate(known));
            }
            return Err(TxError::Isolate(None));
        }
        Ok(())
    }

    /// One savepoint per owned message; a failure rolls back to it and is recorded.
    fn run_isolated(
        &self,
        conn: &mut C,
        run: &Run<'_, '_, '_, C>,
        mut known: Option<(usize, HandlerFailure)>,
        count_contention: bool,
        decisions: &mut Vec<(usize, Decision)>,
    ) -> std::result::Result<(), TxError> {
        let (group, now) = (run.group, run.now);
        for (d, attempts) in run.mine {
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
            let mut replaced = false;
            let mut failed_in_handler = false;
            let outcome = conn.transaction::<_, SavepointError, _>(|conn| {
                let before = depth(conn).map_err(|e| match e {
                    TxError::Retryable(db) => SavepointError::Db(db),
                    _ => SavepointError::Failed(HandlerFailure::Panic(
                        "broken transaction state".into(),
                    )),
                })?;
                let called = Instant::now();
                let result = catch_unwind(AssertUnwindSafe(|| handler.handle_payload(conn, &ctx)));
                self.note_if_hung(called);
                let failure = match result {
                    Ok(Ok(())) => match check_transaction(conn, run.token) {
                        Ok(TxCheck::Ours) => return Ok(()),
                        // Rolling back to the savepoint makes the transaction usable.
                        Ok(TxCheck::Aborted(err)) => HandlerFailure::Handler(
                            HandlerError::transient(SwallowedDatabaseError(err)),
                        ),
                        Ok(TxCheck::Replaced) => {
                            replaced = true;
                            return Err(SavepointError::Db(
                                diesel::result::Error::RollbackTransaction,
                            ));
                        }
                        Err(_) => {
                            return Err(SavepointError::Db(
                                diesel::result::Error::BrokenTransactionManager,
                            ))
                        }
                    },
                    Ok(Err(failure)) => failure,
                    Err(payload) => HandlerFailure::Panic(panic_message(&*payload)),
                };
                if restore_depth(conn, before).is_err() {
                    return Err(SavepointError::Db(
                        diesel::result::Error::BrokenTransactionManager,
                    ));
                }
                failed_in_handler = true;
                Err(SavepointError::Failed(failure))
            });
            // Before anything else: the savepoint's own rollback may have failed too,
            // once the handler ended the transaction it lived in.
            if replaced {
                return Err(run.ended_by(&**handler));
            }
            let decision = match outcome {
                Ok(()) => Decision::Processed,
                // The savepoint exists in the store's own transaction only: its
                // rollback failing after a handler's failure means the handler ended
                // or restarted the transaction.
                Err(SavepointError::Db(err))
                    if failed_in_handler && classify(&err) != ErrorClass::Infrastructure =>
                {
                    return Err(run.ended_by(&**handler))
                }
                Err(SavepointError::Db(err)) => return Err(err.into()),
                Err(SavepointError::Failed(failure)) => {
                    // Rolled back to the message's savepoint, the store's own
                    // transaction is usable again. diesel does not report a savepoint
                    // rollback that failed on an aborted transaction, so look: still
                    // aborted, or another id, means the savepoint was not the store's.
                    if !matches!(check_transaction(conn, run.token)?, TxCheck::Ours) {
                        return Err(run.ended_by(&**handler));
                    }
                    if failure_is_retryable(&failure) && !count_contention {
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
                    // A data error of the database (class 22 or 23) does not heal by
                    // retrying: dead-letter at once instead of climbing the ladder.
                    _ if failure_is_data_error(e) => Err(DeadLetterReason::Permanent),
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
            None => delay.min(MAX_RETRY_DELAY),
        });
        let update = FailureUpdate {
            status: if outcome.is_ok() {
                ClaimStatus::Failed
            } else {
                ClaimStatus::Dead
            },
            next_attempt_at: outcome.as_ref().ok().map(|delay| {
                now.checked_add_signed(delta(*delay))
                    .unwrap_or(DateTime::<Utc>::MAX_UTC)
            }),
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
                    Some(s) if s.digest != row.digest => return Ok(Marked::Collision),
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
        // What is known of the attempts: the broker's deliveries, or the claim's
        // handled failures, whichever is larger.
        let delivered = env
            .delivery_count
            .map_or(0, |n| i32::try_from(n).unwrap_or(i32::MAX));
        let mut conn = self.pool.get()?;
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
            tracing::error!(group = %group, key = %env.message_key, %reason, detail, "delivery dead-lettered");
            metrics::counter!("inbox_dead_lettered_total", "group" => group.to_string(), "reason" => reason.as_str())
                .increment(1);
        }
        Ok(outcome)
    }

    /// A dead letter (`malformed`) for a delivery the store cannot write as it is:
    /// its type and tenant escaped, the raw values kept in headers
    /// (`inbox-raw-message-type`, `inbox-raw-tenant`; JSON keeps a NUL byte), the key
    /// and payload as delivered. No claim is written: there is none the delivery could
    /// take, and its batch-mates go on.
    fn dead_letter_malformed(
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
        let now = self.clock.now();
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
        };
        let mut conn = self.pool.get()?;
        // No claim makes this idempotent: a redelivery finds the letter it left.
        let recorded = C::write_transaction(&mut conn, |conn| {
            if C::has_dead_letter(conn, &row)? {
                return Ok(false);
            }
            C::insert_dead_letter(conn, &row).map(|()| true)
        })?;
        let decision = if recorded {
            tracing::error!(group = %group, key = %env.message_key, error = %last_error, "delivery dead-lettered as malformed");
            Decision::DeadLettered(DeadLetterReason::Malformed)
        } else {
            Decision::AlreadyDeadLettered
        };
        record_metrics(group, [&decision]);
        Ok(decision)
    }

    /// Notes a handler call that outlived the batch deadline (see [`HUNG`]).
    fn note_if_hung(&self, called: Instant) {
        if called.elapsed() >= self.settings.batch_deadline {
            HUNG.with(|h| h.set(true));
        }
    }

    /// A redelivered message: one at a time per group in this process, first a
    /// committed start mark (under the claim's own conflict condition), then the
    /// normal path. Too many unfinished starts dead-letter it as a crash loop.
    fn run_redelivered(&self, group: &ConsumerGroup, d: &Delivery<'_, C>) -> Result<Decision> {
        let slot = self.slot(group);
        let _one_at_a_time = slot.acquire(self.settings.batch_deadline);
        let claim_key = ClaimKey::new(group.clone(), d.env.message_key.clone());
        // This process's last start of the message ended in a store error, not a
        // crash: its mark stays, and this start adds none (only a death counts).
        let errored = self
            .errored_starts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&claim_key);
        let increment = if errored { 0 } else { 1 };
        let mut tries = 0;
        let crashed = loop {
            let now = self.clock.now();
            let mut conn = self.pool.get()?;
            let marked = C::write_transaction(&mut conn, |conn| {
                let Some(starts) = C::mark_start(conn, group, &d.row(), increment, now)? else {
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
                Err(TxError::Data(err)) => {
                    let why = format!("the store could not write the delivery: {err}");
                    return self.dead_letter_malformed(group, d.env, &why);
                }
                Err(TxError::Isolate(_) | TxError::Ended(_)) => {
                    return Err(Error::Internal("a start mark ran no handler"))
                }
            }
        };
        let decision = match crashed {
            Some(decision) => {
                record_metrics(group, [&decision]);
                decision
            }
            None => {
                HUNG.with(|h| h.set(false));
                match self.run_with_retries(group, std::slice::from_ref(&d)) {
                    Ok(mut decisions) => decisions
                        .pop()
                        .map(|(_, decision)| decision)
                        .ok_or(Error::Internal("a delivery was left without a decision"))?,
                    // A store error is not a crash, unless the handler's call
                    // outlived the deadline: then it hung (the server ended the
                    // session under it), and the start counts like a crash. A wait
                    // for a lock (a rebuild's) is not the handler's.
                    Err(err) => {
                        if !HUNG.with(std::cell::Cell::take) {
                            self.errored_starts
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .insert(claim_key);
                        }
                        return Err(err);
                    }
                }
            }
        };
        if errored {
            self.errored_starts
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&claim_key);
        }
        Ok(decision)
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
