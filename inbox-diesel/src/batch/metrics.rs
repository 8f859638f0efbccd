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
