//! The batch's counters, recorded once the decisions they count are final.

use inbox_core::{ConsumerGroup, DeadLetterReason, Decision};

/// Counts decisions by outcome once their transaction committed (or, for a decision
/// that writes nothing, once it is made): one increment per counter and call, not one
/// per delivery (each carries the group label, built once here). Counting inside the
/// transaction would count twice whatever an isolated rerun or a retry after a
/// deadlock decides again.
pub(super) fn record_metrics<'a>(
    group: &ConsumerGroup,
    decisions: impl IntoIterator<Item = &'a Decision>,
) {
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
        (inbox_core::metrics::PROCESSED_TOTAL, processed),
        (inbox_core::metrics::DUPLICATES_TOTAL, duplicates),
        (inbox_core::metrics::RETRIED_TOTAL, retried),
        (inbox_core::metrics::KEY_COLLISIONS_TOTAL, collisions),
        (inbox_core::metrics::PHANTOM_CONFLICTS_TOTAL, violations),
    ] {
        if n > 0 {
            metrics::counter!(name, "group" => group.clone()).increment(n);
        }
    }
    for (reason, n) in dead {
        metrics::counter!(
            inbox_core::metrics::DEAD_LETTERED_TOTAL, "group" => group.clone(), "reason" => reason.as_str()
        )
        .increment(n);
    }
}
