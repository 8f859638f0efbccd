//! The inbox state machine: one consumer group's batch in one transaction, each
//! step in its own module.
//!
//! 1. Orchestration (this module): de-duplicate inside the batch, in rounds of
//!    distinct keys; first deliveries together, redeliveries through the crash slot.
//!    Every step works on [`delivery::Delivery`]s and reports [`tx::TxError`].
//! 2. [`retry`]: the batch transaction, run again after contention (bounded), split
//!    in halves, or split on a data error until the delivery is alone.
//! 3. [`claim`]: lock before claim, claim in key order (digest and due time in the
//!    conflict condition), look up keys not returned by the same claim key, and
//!    [`claim::decide`] what a stored claim means: collision, duplicate, dead, not
//!    yet due, or (no row at all) a phantom conflict.
//! 4. Running the owned messages' handlers after the claims: [`optimistic`] (all at
//!    once) and, if anything fails, [`isolated`] (a savepoint per message); [`run`]
//!    holds what both share (depth repair, panics, hangs) and [`ownership`] whether
//!    the transaction is still the store's after a handler call.
//! 5. [`failure`]: a failure recorded by the same claim key, its retry or dead
//!    letter; [`dead_letter`]: collisions, malformed deliveries, the broker's dead
//!    letters; [`crash_loop`]: redelivered messages' start marks.
//! 6. Commit once; [`metrics`] counts what committed; the transport acts on the
//!    decisions.

mod claim;
mod crash_loop;
mod dead_letter;
mod delivery;
mod failure;
mod isolated;
mod metrics;
mod optimistic;
mod ownership;
mod retry;
mod run;
mod tx;

use std::collections::HashMap;

use inbox_core::{ConsumerGroup, Decision, Envelope, MessageKey};

use crate::backend::StoreConnection;
use crate::store::Inner;
use crate::{Error, Result};
use dead_letter::unstorable_field;
use delivery::{Delivery, SharedHandler};
use metrics::record_metrics;

/// A copy later in the batch with the same digest takes the first copy's decision.
fn copy_decision(first: &Decision) -> Decision {
    match first {
        Decision::Processed | Decision::Duplicate => Decision::Duplicate,
        Decision::DeadLettered(_) | Decision::AlreadyDeadLettered => Decision::AlreadyDeadLettered,
        other => other.clone(),
    }
}

/// One round's deliveries: the first of each key, later copies with the first's
/// digest (and the first's index), and copies with another digest, for a later round.
struct Round<'a, C> {
    owners: Vec<Delivery<'a, C>>,
    copies: Vec<(Delivery<'a, C>, usize)>,
    later: Vec<Delivery<'a, C>>,
}

/// Splits pending deliveries into a round: each key once (a multi-row upsert cannot
/// touch a row twice). A later copy with the owner's digest takes the owner's
/// decision; one with another digest waits for the next round, where it is judged
/// against the stored claim like any delivery, so an impostor that comes first never
/// takes the real retry down with it.
fn round<C>(pending: Vec<Delivery<'_, C>>) -> Round<'_, C> {
    let mut owner_of: HashMap<&MessageKey, usize> = HashMap::new();
    let mut round = Round {
        owners: Vec::new(),
        copies: Vec::new(),
        later: Vec::new(),
    };
    for d in pending {
        match owner_of.get(&d.env.message_key) {
            None => {
                owner_of.insert(&d.env.message_key, round.owners.len());
                round.owners.push(d);
            }
            Some(&o) if round.owners[o].digest == d.digest => {
                let owner = round.owners[o].idx;
                round.copies.push((d, owner));
            }
            Some(_) => round.later.push(d),
        }
    }
    round
}

impl<C: StoreConnection> Inner<C> {
    pub(crate) fn process(
        &self,
        group: &ConsumerGroup,
        batch: &[Envelope],
    ) -> Result<Vec<Decision>> {
        let span = tracing::debug_span!("inbox.batch", group = %group, size = batch.len());
        let _entered = span.enter();

        // Each delivery's span: the producer's trace is its parent, the handler runs
        // inside it.
        let spans: Vec<tracing::Span> = batch
            .iter()
            .map(|env| inbox_core::trace::delivery_span(group, env))
            .collect();
        let (mut pending, unstorable) = self.deliveries(group, batch, &spans);

        let mut decisions: Vec<Option<Decision>> = vec![None; batch.len()];
        for (d, why) in &unstorable {
            decisions[d.idx] = Some(self.dead_letter_malformed(group, d.env, why)?);
        }
        while !pending.is_empty() {
            let Round {
                owners,
                copies,
                later,
            } = round(pending);
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

    /// The batch's deliveries with their handlers, and apart those the store cannot
    /// write as they are (with why).
    #[allow(clippy::type_complexity)]
    fn deliveries<'a>(
        &'a self,
        group: &ConsumerGroup,
        batch: &'a [Envelope],
        spans: &[tracing::Span],
    ) -> (Vec<Delivery<'a, C>>, Vec<(Delivery<'a, C>, String)>) {
        // The handler of each message type, looked up once per batch.
        let mut by_type: Vec<(&str, Option<&SharedHandler<C>>)> = Vec::new();
        let mut pending = Vec::with_capacity(batch.len());
        let mut unstorable = Vec::new();
        for (idx, env) in batch.iter().enumerate() {
            let handler = match by_type.iter().find(|(t, _)| *t == env.message_type) {
                Some(&(_, handler)) => handler,
                None => {
                    let handler = self.handler(group, &env.message_type);
                    by_type.push((&env.message_type, handler));
                    handler
                }
            };
            let delivery = Delivery {
                idx,
                env,
                digest: if self.knobs().digest() {
                    env.payload_digest()
                } else {
                    [0; 32]
                },
                handler,
                span: spans[idx].clone(),
            };
            match unstorable_field(env) {
                Some(why) => unstorable.push((delivery, why)),
                None => pending.push(delivery),
            }
        }
        (pending, unstorable)
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
}
