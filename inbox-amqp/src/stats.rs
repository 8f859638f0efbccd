use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use inbox_core::{ConsumerGroup, Tally};

/// Counters of a running consumer, shared with whoever holds it.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    received: AtomicU64,
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    malformed: AtomicU64,
    delivery_limit: AtomicU64,
    requeued: AtomicU64,
    batches: AtomicU64,
    reconnects: AtomicU64,
    retries_per_tier: Mutex<BTreeMap<Duration, u64>>,
    halted: Mutex<BTreeMap<String, String>>,
}

/// A copy of the counters at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Deliveries received from group queues.
    pub received: u64,
    /// Deliveries whose handler ran and committed.
    pub processed: u64,
    /// Deliveries acked as duplicates (including already dead-lettered ones).
    pub duplicates: u64,
    /// Deliveries sent to a retry tier.
    pub retried: u64,
    /// Deliveries dead-lettered by the store (all reasons but the two below).
    pub dead_lettered: u64,
    /// Deliveries that could not be read as an envelope.
    pub malformed: u64,
    /// Dead letters read from the broker's dead-letter queues.
    pub delivery_limit: u64,
    /// Deliveries put back unacked (store failure, failed retry publish).
    pub requeued: u64,
    /// Batches handed to the store.
    pub batches: u64,
    /// Connections re-established after a loss, summed over the consumer's
    /// connections (two per consumer group).
    pub reconnects: u64,
    /// Retries per retry tier.
    pub retries_per_tier: BTreeMap<Duration, u64>,
    /// The consumer groups halted now, each with why; a group that resumed is no
    /// longer named (see [`Consumer`](crate::Consumer)).
    pub halted: BTreeMap<String, String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    Received,
    Processed,
    Duplicates,
    Retried,
    DeadLettered,
    Malformed,
    DeliveryLimit,
    Requeued,
    Batches,
    Reconnects,
}

impl ConsumerStats {
    pub(crate) fn add(&self, counter: Counter, n: u64) {
        let cell = match counter {
            Counter::Received => &self.received,
            Counter::Processed => &self.processed,
            Counter::Duplicates => &self.duplicates,
            Counter::Retried => &self.retried,
            Counter::DeadLettered => &self.dead_lettered,
            Counter::Malformed => &self.malformed,
            Counter::DeliveryLimit => &self.delivery_limit,
            Counter::Requeued => &self.requeued,
            Counter::Batches => &self.batches,
            Counter::Reconnects => &self.reconnects,
        };
        cell.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one settled delivery under the counter of its tally.
    pub(crate) fn record(&self, tally: Tally) {
        let counter = match tally {
            Tally::Processed => Counter::Processed,
            Tally::Duplicate => Counter::Duplicates,
            Tally::DeadLettered => Counter::DeadLettered,
            Tally::Retried => Counter::Retried,
        };
        self.add(counter, 1);
    }

    pub(crate) fn retried_to(&self, tier: Duration) {
        *self
            .retries_per_tier
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(tier)
            .or_default() += 1;
    }

    /// Records that `group` halted; whether it had not halted before.
    pub(crate) fn halt(&self, group: &ConsumerGroup, cause: String) -> bool {
        let mut halted = self.halted.lock().unwrap_or_else(PoisonError::into_inner);
        match halted.entry(group.to_string()) {
            Entry::Occupied(_) => false,
            Entry::Vacant(entry) => {
                entry.insert(cause);
                true
            }
        }
    }

    /// Forgets that `group` halted (it resumed).
    pub(crate) fn resume(&self, group: &ConsumerGroup) {
        self.halted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(group.as_str());
    }

    /// Whether `group` halted.
    pub(crate) fn is_halted(&self, group: &ConsumerGroup) -> bool {
        self.halted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(group.as_str())
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            received: get(&self.received),
            processed: get(&self.processed),
            duplicates: get(&self.duplicates),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            malformed: get(&self.malformed),
            delivery_limit: get(&self.delivery_limit),
            requeued: get(&self.requeued),
            batches: get(&self.batches),
            reconnects: get(&self.reconnects),
            retries_per_tier: self
                .retries_per_tier
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            halted: self
                .halted
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tally_counts_under_its_own_counter() {
        let stats = ConsumerStats::default();
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
        let s = stats.snapshot();
        assert_eq!(
            (s.processed, s.duplicates, s.dead_lettered, s.retried),
            (1, 2, 3, 4)
        );
        assert_eq!((s.received, s.requeued, s.malformed), (0, 0, 0));
    }
}
