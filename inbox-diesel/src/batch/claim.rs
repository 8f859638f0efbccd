//! Claim and lookup: one attempt of the batch transaction takes the projection locks,
//! claims in key order, looks up the keys the claim did not return, decides what each
//! stored claim means ([`decide`]), then hands the owned messages to the handlers.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;

use diesel::connection::{AnsiTransactionManager, TransactionManager};

use chrono::{DateTime, Utc};
use inbox_core::display::Escaped;
use inbox_core::{
    ClaimInvariantViolated, ConsumerGroup, DeadLetterReason, Decision, DynHandler, HandlerFailure,
    MessageKey, ProjectionLock, MAX_RETRY_DELAY,
};

use super::delivery::Delivery;
use super::ownership::{ownership_after_failure, Ownership};
use super::run::{depth, ended, Mode, Run};
use super::tx::TxError;
use crate::backend::{classify, ErrorClass, StoreConnection};
use crate::rows::{ClaimRow, Stored};
use crate::store::Inner;
use crate::ClaimStatus;

/// What one attempt of a batch transaction works on.
pub(super) struct Attempt<'a, 'd, 'e, C> {
    pub(super) group: &'a ConsumerGroup,
    pub(super) items: &'a [&'d Delivery<'e, C>],
    /// The batch's `now`, the same for every statement of every attempt.
    pub(super) now: DateTime<Utc>,
    /// Set when a handler ended the transaction: the rollbacks that follow can fail
    /// and replace the error, so the finding is kept here.
    pub(super) ended: &'a Cell<Option<String>>,
}

/// What a stored claim means for a delivery the claim statement did not return.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// Decided: a duplicate, already dead-lettered, or a retry not yet due.
    Decision(Decision),
    /// Another payload holds the key: the newcomer is dead-lettered.
    Collision,
    /// The claim invariant is broken (the detail says how): the group stops.
    Phantom(String),
}

/// Decides what a stored claim means for a delivery of `digest` that the claim
/// statement did not take at `now`. Pure: the caller writes what it implies.
pub(super) fn decide(stored: Option<&Stored>, digest: &[u8], now: DateTime<Utc>) -> Found {
    let Some(s) = stored else {
        return Found::Phantom(
            "the claim insert conflicted but no row exists under the same claim key".to_owned(),
        );
    };
    if s.collides(digest) {
        return Found::Collision;
    }
    match ClaimStatus::parse(&s.status) {
        Some(ClaimStatus::Done) => Found::Decision(Decision::Duplicate),
        Some(ClaimStatus::Dead) => Found::Decision(Decision::AlreadyDeadLettered),
        Some(ClaimStatus::Failed | ClaimStatus::Started) => {
            match s.next_attempt_at.map(|t| (t - now).to_std()) {
                // At most the longest retry delay: after the clock stepped back, a stored
                // retry can lie further ahead than any delay ever asked for.
                Some(Ok(wait)) if !wait.is_zero() => {
                    Found::Decision(Decision::RetryAfter(wait.min(MAX_RETRY_DELAY)))
                }
                _ => Found::Phantom(
                    "the claim insert conflicted with a row it should have taken over".to_owned(),
                ),
            }
        }
        None => Found::Phantom(format!("unknown claim status {:?}", s.status)),
    }
}

/// The claim table rejected or lost a claim its lookup cannot explain: halt the group,
/// loudly. Acking it as a duplicate would drop the message's effect silently.
pub(super) fn phantom(group: &ConsumerGroup, key: &MessageKey, detail: &str) -> Decision {
    tracing::error!(group = %group, key = %Escaped(key.as_str()), detail = %Escaped(detail), "claim invariant violated: stopping the consumer group");
    Decision::Stop(ClaimInvariantViolated {
        group: group.clone(),
        key: key.clone(),
        detail: detail.to_owned(),
    })
}

/// The projection locks of a batch's handlers: in id order, each once (exclusive if
/// any handler wants it so), so that batches never wait for each other's locks in
/// opposite orders.
fn locks<C: 'static>(
    items: &[&Delivery<'_, C>],
    key: impl Fn(&ProjectionLock) -> i64,
) -> Vec<(i64, bool)> {
    let mut locks: Vec<(i64, bool)> = items
        .iter()
        .filter_map(|d| d.handler.and_then(|h| h.lock()))
        .map(|l| (key(&l), l.is_exclusive()))
        .collect();
    locks.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    locks.dedup_by_key(|l| l.0);
    locks
}

/// The owned deliveries (with their attempts before this one), the decisions of the
/// others, and the transaction's token the claim read.
type ClaimedBy<'d, 'e, C> = (
    Vec<(&'d Delivery<'e, C>, i32)>,
    Vec<(usize, Decision)>,
    Option<String>,
);

impl<C: StoreConnection> Inner<C> {
    /// One attempt of the batch transaction: locks, claims, lookups, then the
    /// handlers in `mode` (`known`: a failure the optimistic run already saw), then
    /// the commit, with the check of the last handler call when it is still due.
    pub(super) fn attempt(
        &self,
        conn: &mut C,
        at: &Attempt<'_, '_, '_, C>,
        mode: Mode,
        known: Option<(usize, HandlerFailure)>,
    ) -> std::result::Result<Vec<(usize, Decision)>, TxError> {
        let checks = self.knobs().commit_checks();
        C::begin_batch(conn, checks)?;
        match self.claim_and_run(conn, at, mode, known, checks) {
            Ok((decisions, None)) => {
                C::commit_batch(conn, None)?;
                Ok(decisions)
            }
            Ok((decisions, Some(unchecked))) => {
                self.commit_checked(conn, at, &unchecked)?;
                Ok(decisions)
            }
            Err(err) => Err(rollback(conn, err)),
        }
    }

    /// The body of [`attempt`](Self::attempt), inside its transaction; with the
    /// handler call whose check the commit makes, if any.
    fn claim_and_run(
        &self,
        conn: &mut C,
        at: &Attempt<'_, '_, '_, C>,
        mode: Mode,
        known: Option<(usize, HandlerFailure)>,
        checks: bool,
    ) -> std::result::Result<Ran<C>, TxError> {
        // Lock before claim: a projection rebuild holds the lock exclusively, so live
        // batches wait for it instead of double counting beside it.
        C::take_locks(conn, &locks(at.items, |l| self.lock_key(l)))?;
        let (mine, mut decisions, token) = self.claim_all(conn, at)?;

        // Handlers run only after every claim of the batch is taken. The token was
        // read by the claim statement; it is read again after each handler call (the
        // last one's check is made by the commit itself).
        let token = if checks && mine.iter().any(|(d, _)| d.handler.is_some()) {
            token
        } else {
            None
        };
        let run = Run {
            group: at.group,
            mine: &mine,
            now: at.now,
            token: token.as_deref(),
            ended: at.ended,
        };
        let unchecked = match mode {
            Mode::Optimistic => self.run_optimistic(conn, &run, &mut decisions)?,
            Mode::Isolated { count_contention } => {
                self.run_isolated(conn, &run, known, count_contention, &mut decisions)?;
                None
            }
        };
        let unchecked = match (unchecked, token) {
            (Some(handler), Some(token)) => Some(Unchecked { handler, token }),
            _ => None,
        };
        Ok((decisions, unchecked))
    }

    /// Commits with the check of the last handler call, in one round trip. If the
    /// check fails, the transaction was aborted by an error the handler swallowed (run
    /// the batch isolated, where its failure is recorded) or is not the store's any
    /// more (the handler ended or restarted it).
    fn commit_checked(
        &self,
        conn: &mut C,
        at: &Attempt<'_, '_, '_, C>,
        unchecked: &Unchecked<C>,
    ) -> std::result::Result<(), TxError> {
        // The handler's own COMMIT or ROLLBACK left no transaction, as libpq reported
        // to diesel's transaction manager.
        if depth(conn)? == 0 {
            return Err(ended(at.ended, &*unchecked.handler));
        }
        let err = match C::commit_batch(conn, Some(&unchecked.token)) {
            Ok(()) => return Ok(()),
            Err(err) => err,
        };
        if classify(&err) == ErrorClass::Infrastructure {
            return Err(rollback(conn, err.into()));
        }
        // The check passed and the COMMIT itself failed: the transaction is over and
        // nothing committed, as when diesel commits.
        if depth(conn)? == 0 {
            return Err(err.into());
        }
        let err = match ownership_after_failure(conn, Some(&unchecked.token)) {
            Ok(Ownership::Replaced) => ended(at.ended, &*unchecked.handler),
            Ok(Ownership::Usable | Ownership::WasAborted) => TxError::Isolate(None),
            Err(err) => err,
        };
        Err(rollback(conn, err))
    }

    /// Claims in key order, so concurrent batches lock rows in the same order; then
    /// decides every delivery the claim did not return from its stored claim.
    fn claim_all<'d, 'e>(
        &self,
        conn: &mut C,
        at: &Attempt<'_, 'd, 'e, C>,
    ) -> std::result::Result<ClaimedBy<'d, 'e, C>, TxError> {
        let (group, now) = (at.group, at.now);
        let mut sorted: Vec<&'d Delivery<'e, C>> = at.items.to_vec();
        sorted.sort_by(|a, b| a.key().cmp(b.key()));
        let rows: Vec<ClaimRow<'_>> = sorted.iter().map(|d| d.row()).collect();
        let claimed = C::claim(conn, group, &rows, now, self.knobs())?;
        let owned: HashMap<String, i32> = claimed.owned.into_iter().collect();

        let missing: Vec<&str> = sorted
            .iter()
            .map(|d| d.key())
            .filter(|k| !owned.contains_key(*k))
            .collect();
        // A statement of its own, not a CTE of the claim: under READ COMMITTED it
        // takes a new snapshot, so it sees the row of a concurrent claimer that
        // committed while our insert waited on it. Inside the claim statement that
        // row would be invisible and look like a phantom conflict.
        let stored: HashMap<String, Stored> = if missing.is_empty() || !self.knobs().lookup() {
            HashMap::new()
        } else {
            C::lookup(conn, group, &missing)?
                .into_iter()
                .map(|s| (s.key.clone(), s))
                .collect()
        };

        let mut decisions = Vec::with_capacity(at.items.len());
        let mut mine = Vec::with_capacity(owned.len());
        for d in sorted {
            if let Some(&attempts) = owned.get(d.key()) {
                mine.push((d, attempts));
                continue;
            }
            if !self.knobs().lookup() {
                decisions.push((d.idx, Decision::Duplicate));
                continue;
            }
            let decision = match decide(stored.get(d.key()), &d.digest, now) {
                Found::Decision(decision) => decision,
                Found::Collision => {
                    self.dead_letter_collision(conn, group, d, now, "the claimed message")?;
                    Decision::DeadLettered(DeadLetterReason::KeyCollision)
                }
                Found::Phantom(detail) => phantom(group, &d.env.message_key, &detail),
            };
            decisions.push((d.idx, decision));
        }
        Ok((mine, decisions, claimed.token))
    }
}

/// The decisions of a batch transaction's body, and the handler call whose check the
/// commit makes, if any.
type Ran<C> = (Vec<(usize, Decision)>, Option<Unchecked<C>>);

/// The last handler call of an optimistic run, whose check the commit makes.
struct Unchecked<C> {
    handler: Arc<dyn DynHandler<C>>,
    token: String,
}

/// Rolls the batch transaction back after `err`, as diesel's `transaction` does: a
/// rollback that fails (other than on a broken transaction manager) is the error.
fn rollback<C: StoreConnection>(conn: &mut C, err: TxError) -> TxError {
    match AnsiTransactionManager::rollback_transaction(conn) {
        Ok(()) | Err(diesel::result::Error::BrokenTransactionManager) => err,
        Err(rollback) => rollback.into(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use chrono::TimeDelta;

    use super::*;

    /// The wait of a retry that is not yet due.
    fn wait(d: &Found) -> Option<Duration> {
        match d {
            Found::Decision(Decision::RetryAfter(wait)) => Some(*wait),
            _ => None,
        }
    }

    const DIGEST: [u8; 32] = [7; 32];

    fn stored(status: &str, next_attempt_at: Option<DateTime<Utc>>) -> Stored {
        Stored {
            key: "k".to_owned(),
            status: status.to_owned(),
            digest: DIGEST.to_vec(),
            next_attempt_at,
        }
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap_or_default()
    }

    fn is_phantom(found: &Found) -> bool {
        matches!(found, Found::Phantom(_))
    }

    #[test]
    fn no_row_under_the_claim_key_is_a_phantom_conflict() {
        assert!(is_phantom(&decide(None, &DIGEST, now())));
    }

    #[test]
    fn another_payload_is_a_collision_whatever_the_status() {
        for status in ["done", "dead", "failed", "started", "bogus"] {
            let mut s = stored(status, None);
            s.digest = vec![8; 32];
            assert_eq!(
                decide(Some(&s), &DIGEST, now()),
                Found::Collision,
                "{status}"
            );
        }
    }

    #[test]
    fn done_is_a_duplicate_and_dead_already_dead_lettered() {
        assert_eq!(
            decide(Some(&stored("done", None)), &DIGEST, now()),
            Found::Decision(Decision::Duplicate)
        );
        assert_eq!(
            decide(Some(&stored("dead", None)), &DIGEST, now()),
            Found::Decision(Decision::AlreadyDeadLettered)
        );
    }

    #[test]
    fn a_retry_not_yet_due_waits_for_the_rest_of_its_delay() {
        for status in ["failed", "started"] {
            let due = now() + TimeDelta::seconds(30);
            let found = decide(Some(&stored(status, Some(due))), &DIGEST, now());
            assert_eq!(wait(&found), Some(Duration::from_secs(30)), "{status}");
        }
    }

    #[test]
    fn a_due_row_the_claim_did_not_take_over_is_a_phantom_conflict() {
        for status in ["failed", "started"] {
            for next in [None, Some(now()), Some(now() - TimeDelta::seconds(1))] {
                let found = decide(Some(&stored(status, next)), &DIGEST, now());
                assert!(is_phantom(&found), "{status} {next:?}: {found:?}");
            }
        }
    }

    #[test]
    fn an_unknown_status_is_a_phantom_conflict_naming_it() {
        match decide(Some(&stored("bogus", None)), &DIGEST, now()) {
            Found::Phantom(detail) => assert!(detail.contains("\"bogus\""), "{detail}"),
            other => panic!("expected a phantom conflict, found {other:?}"),
        }
    }
}
