use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::{
    check_decision_count, clock::delta, ClaimInvariantViolated, Clock, ConsumerGroup, Envelope,
    Error, InboxStore, Result, SystemClock, Tally, TransportAction,
};

/// An in-process, at-least-once transport: a queue per consumer group, in memory.
///
/// It behaves like a broker as far as the inbox can tell: a delivery the store could
/// not commit comes back flagged `redelivered`; a retry comes back after its delay as
/// a fresh delivery; a `Stop` halts the consumer group and leaves the delivery queued.
/// It is for the quickstart, for embedded use with SQLite, and for users' own tests.
///
/// ```
/// # use inbox_core::*;
/// # struct Store;
/// # impl InboxStore for Store {
/// #     fn process_batch(&self, _: &ConsumerGroup, b: &[Envelope]) -> Result<Vec<Decision>> {
/// #         Ok(b.iter().map(|_| Decision::Processed).collect())
/// #     }
/// #     fn routes(&self) -> Vec<(ConsumerGroup, String)> {
/// #         vec![(ConsumerGroup::new("billing.daily-usage").unwrap(), "usage.recorded".into())]
/// #     }
/// #     fn dead_letter(&self, _: &ConsumerGroup, _: &Envelope, _: DeadLetterReason, _: &str)
/// #         -> Result<DeadLetterOutcome> { Ok(DeadLetterOutcome::Recorded) }
/// # }
/// let mut transport = InProcessTransport::new(Store).batch_size(100);
/// let key = MessageKey::derive("billing", "event-1", "usage.recorded");
/// transport.publish(Envelope::new(key, "usage.recorded", b"{}".to_vec()))?;
/// let stats = transport.run_until_idle()?;
/// assert_eq!(stats.processed, 1);
/// # Ok::<(), inbox_core::Error>(())
/// ```
pub struct InProcessTransport<S> {
    store: S,
    clock: Arc<dyn Clock>,
    batch_size: usize,
    routes: Vec<(ConsumerGroup, String)>,
    queues: BTreeMap<ConsumerGroup, GroupQueue>,
    stats: TransportStats,
}

#[derive(Default)]
struct GroupQueue {
    ready: VecDeque<Envelope>,
    delayed: Vec<(DateTime<Utc>, Envelope)>,
    halted: Option<ClaimInvariantViolated>,
}

/// What a transport has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportStats {
    /// Deliveries handed to the store.
    pub delivered: u64,
    /// Deliveries whose handler ran and committed.
    pub processed: u64,
    /// Deliveries acked as duplicates (including already dead-lettered ones).
    pub duplicates: u64,
    /// Deliveries scheduled for a retry.
    pub retries: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries put back unacked because the store failed (they come back redelivered).
    pub requeued: u64,
}

impl TransportStats {
    /// Counts one settled delivery under `tally`.
    pub fn record(&mut self, tally: Tally) {
        let counter = match tally {
            Tally::Processed => &mut self.processed,
            Tally::Duplicate => &mut self.duplicates,
            Tally::DeadLettered => &mut self.dead_lettered,
            Tally::Retried => &mut self.retries,
        };
        *counter += 1;
    }
}

impl<S: InboxStore> InProcessTransport<S> {
    /// A transport over `store`, on the system clock, one delivery per batch.
    pub fn new(store: S) -> Self {
        let routes = store.routes();
        let queues = routes
            .iter()
            .map(|(group, _)| (group.clone(), GroupQueue::default()))
            .collect();
        Self {
            store,
            clock: Arc::new(SystemClock),
            batch_size: 1,
            routes,
            queues,
            stats: TransportStats::default(),
        }
    }

    /// Uses `clock` for retry delays (a manual clock makes waiting instant).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Hands up to `n` deliveries to the store at once (at least 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Routes `envelope` to every group with a handler for its message type, like a
    /// topic exchange; returns how many groups it reached.
    pub fn publish(&mut self, envelope: Envelope) -> Result<usize> {
        let groups: Vec<ConsumerGroup> = self
            .routes
            .iter()
            .filter(|(_, ty)| *ty == envelope.message_type)
            .map(|(group, _)| group.clone())
            .collect();
        if groups.is_empty() {
            return Err(Error::Unroutable {
                message_type: envelope.message_type,
            });
        }
        for group in &groups {
            self.deliver(group, envelope.clone());
        }
        Ok(groups.len())
    }

    /// Queues `envelope` for `group` alone, if this transport consumes that group
    /// (a replay, see [`crate::replay_target`]); returns 1.
    pub fn deliver_to(&mut self, group: &ConsumerGroup, envelope: Envelope) -> Result<usize> {
        if !self.queues.contains_key(group) {
            return Err(Error::UnknownGroup {
                group: group.to_string(),
            });
        }
        self.deliver(group, envelope);
        Ok(1)
    }

    /// Queues `envelope` for `group` exactly as given (a test can hand in a
    /// redelivered copy or a type no handler takes).
    pub fn deliver(&mut self, group: &ConsumerGroup, envelope: Envelope) {
        self.queues
            .entry(group.clone())
            .or_default()
            .ready
            .push_back(envelope);
    }

    /// Deliveries waiting, ready or delayed.
    pub fn pending(&self) -> usize {
        self.queues
            .values()
            .map(|q| q.ready.len() + q.delayed.len())
            .sum()
    }

    /// What has happened so far.
    pub fn stats(&self) -> TransportStats {
        self.stats
    }

    /// Delivers until nothing is left, waiting out retry delays on the clock.
    ///
    /// Returns the store's error after putting the failed batch back (redelivered),
    /// or [`Error::ClaimInvariantViolated`] after halting the group concerned.
    pub fn run_until_idle(&mut self) -> Result<TransportStats> {
        loop {
            let mut worked = false;
            let groups: Vec<ConsumerGroup> = self.queues.keys().cloned().collect();
            for group in &groups {
                worked |= self.run_one_batch(group)?;
            }
            if worked {
                continue;
            }
            let now = self.clock.now();
            let next_due = self
                .queues
                .values()
                .filter(|q| q.halted.is_none())
                .flat_map(|q| q.delayed.iter().map(|(due, _)| *due))
                .min();
            match next_due {
                Some(due) => {
                    if let Ok(wait) = (due - now).to_std() {
                        self.clock.sleep(wait);
                    }
                }
                None => return Ok(self.stats),
            }
        }
    }

    fn run_one_batch(&mut self, group: &ConsumerGroup) -> Result<bool> {
        let now = self.clock.now();
        let Some(queue) = self.queues.get_mut(group) else {
            return Ok(false);
        };
        if queue.halted.is_some() {
            return Ok(false);
        }
        let (due, later): (Vec<_>, Vec<_>) = queue.delayed.drain(..).partition(|(t, _)| *t <= now);
        queue.delayed = later;
        queue.ready.extend(due.into_iter().map(|(_, env)| env));
        let take = queue.ready.len().min(self.batch_size);
        if take == 0 {
            return Ok(false);
        }
        let batch: Vec<Envelope> = queue.ready.drain(..take).collect();
        self.stats.delivered += batch.len() as u64;

        let decided = self
            .store
            .process_batch(group, &batch)
            .and_then(|d| check_decision_count(d, batch.len()));
        let decisions = match decided {
            Ok(d) => d,
            Err(err) => {
                self.requeue(group, batch);
                return Err(err);
            }
        };

        let mut stop = None;
        for (envelope, decision) in batch.into_iter().zip(decisions) {
            match decision.action() {
                TransportAction::Ack(tally) => self.stats.record(tally),
                TransportAction::RetryThenAck(delay) => {
                    // Scheduling in memory cannot fail: counted at once.
                    self.stats.record(Tally::Retried);
                    // A retry comes back as a fresh delivery, not a redelivery.
                    let mut copy = envelope;
                    copy.redelivered = false;
                    copy.delivery_count = None;
                    if let Some(queue) = self.queues.get_mut(group) {
                        queue.delayed.push((now + delta(delay), copy));
                    }
                }
                TransportAction::HoldAndStop(violation) => {
                    if let Some(queue) = self.queues.get_mut(group) {
                        let mut back = envelope;
                        back.redelivered = true;
                        queue.ready.push_front(back);
                        queue.halted = Some(violation.clone());
                    }
                    stop = Some(violation);
                }
            }
        }
        match stop {
            Some(violation) => Err(Error::ClaimInvariantViolated(violation)),
            None => Ok(true),
        }
    }

    fn requeue(&mut self, group: &ConsumerGroup, batch: Vec<Envelope>) {
        self.stats.requeued += batch.len() as u64;
        if let Some(queue) = self.queues.get_mut(group) {
            for mut envelope in batch.into_iter().rev() {
                envelope.redelivered = true;
                envelope.delivery_count = Some(envelope.delivery_count.unwrap_or(0) + 1);
                queue.ready.push_front(envelope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::{Decision, ManualClock, MessageKey};

    /// Retries every message once, fails the whole batch once, then processes.
    struct Flaky {
        seen: Mutex<Vec<(String, bool)>>,
        fail_next: Mutex<bool>,
    }

    impl InboxStore for Flaky {
        fn process_batch(&self, _: &ConsumerGroup, batch: &[Envelope]) -> Result<Vec<Decision>> {
            let mut seen = self.seen.lock().unwrap();
            let mut fail = self.fail_next.lock().unwrap();
            if *fail {
                *fail = false;
                return Err(Error::Store("database went away".into()));
            }
            Ok(batch
                .iter()
                .map(|env| {
                    let key = env.message_key.to_string();
                    let first = !seen.iter().any(|(k, _)| *k == key);
                    seen.push((key, env.redelivered));
                    if first {
                        Decision::RetryAfter(Duration::from_secs(30))
                    } else {
                        Decision::Processed
                    }
                })
                .collect())
        }

        fn routes(&self) -> Vec<(ConsumerGroup, String)> {
            vec![(ConsumerGroup::new("g").unwrap(), "t".into())]
        }

        fn dead_letter(
            &self,
            _: &ConsumerGroup,
            _: &Envelope,
            _: crate::DeadLetterReason,
            _: &str,
        ) -> Result<crate::DeadLetterOutcome> {
            Ok(crate::DeadLetterOutcome::Recorded)
        }
    }

    #[test]
    fn retries_come_back_fresh_and_failed_batches_come_back_redelivered() {
        let store = Flaky {
            seen: Mutex::new(vec![]),
            fail_next: Mutex::new(true),
        };
        let clock = ManualClock::new("2026-01-01T00:00:00Z".parse().unwrap());
        let start = clock.now();
        let mut t = InProcessTransport::new(store).with_clock(Arc::new(clock.clone()));
        let env = Envelope::new(MessageKey::new("k").unwrap(), "t", vec![]);
        assert_eq!(t.publish(env).unwrap(), 1);
        assert!(t.run_until_idle().is_err());
        assert_eq!(t.pending(), 1);
        let stats = t.run_until_idle().unwrap();
        assert_eq!((stats.requeued, stats.retries, stats.processed), (1, 1, 1));
        let seen = t.store().seen.lock().unwrap().clone();
        // First handed over redelivered (after the failed batch), then fresh (retry).
        assert_eq!(seen, [("k".into(), true), ("k".into(), false)]);
        assert_eq!((clock.now() - start).num_seconds(), 30);
    }

    #[test]
    fn every_tally_counts_under_its_own_counter() {
        let mut stats = TransportStats::default();
        for (tally, times) in [
            (Tally::Processed, 1),
            (Tally::Duplicate, 2),
            (Tally::DeadLettered, 3),
            (Tally::Retried, 4),
        ] {
            for _ in 0..times {
                stats.record(tally);
            }
        }
        let counted = (
            stats.processed,
            stats.duplicates,
            stats.dead_lettered,
            stats.retries,
        );
        assert_eq!(counted, (1, 2, 3, 4));
        assert_eq!((stats.delivered, stats.requeued), (0, 0));
    }

    #[test]
    fn unroutable_publish_is_an_error() {
        let store = Flaky {
            seen: Mutex::new(vec![]),
            fail_next: Mutex::new(false),
        };
        let mut t = InProcessTransport::new(store);
        let env = Envelope::new(MessageKey::new("k").unwrap(), "other", vec![]);
        assert!(matches!(t.publish(env), Err(Error::Unroutable { .. })));
    }
}
