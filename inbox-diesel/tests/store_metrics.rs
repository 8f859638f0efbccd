//! What the store reports through the `metrics` facade, counted per outcome and
//! group: the counters an operator alerts on must move exactly with the decisions.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::time::Duration;

use inbox_core::{DeadLetterReason, Decision, RetryPolicy};
use inbox_test_support::metrics::capture;
use inbox_test_support::{group, usage, Fixture, Outcome, Recorder, TestConn};

const GROUP: &str = "billing.daily-usage";

inbox_test_support::on_both_backends!(counters_follow_the_decisions);

fn counters_follow_the_decisions<F: Fixture>(fx: &F) {
    let policy = RetryPolicy::new(2, Duration::from_millis(1), Duration::from_millis(1)).unwrap();
    let handler = Recorder::new(GROUP)
        .policy(policy)
        .behaviour(|key, _| match key {
            k if k.starts_with("flaky") => Outcome::ApplyThenFail,
            k if k.starts_with("invalid") => Outcome::Permanent,
            _ => Outcome::Apply,
        });
    let store = fx.builder().handler(handler).build().expect("store");
    fx.connect().create_effects().expect("effects");
    let g = group(GROUP);
    let labels = [("group", GROUP)];

    let (decisions, first) = capture(|| {
        store
            .process_batch(
                &g,
                &[
                    usage("a", 1),
                    usage("b", 2),
                    usage("a", 1),
                    usage("flaky", 3),
                    usage("invalid", 4),
                ],
            )
            .unwrap()
    });
    assert_eq!(
        decisions,
        [
            Decision::Processed,
            Decision::Processed,
            Decision::Duplicate,
            Decision::RetryAfter(Duration::from_millis(1)),
            Decision::DeadLettered(DeadLetterReason::Permanent),
        ]
    );
    assert_eq!(first.counter("inbox_processed_total", &labels), 2);
    assert_eq!(first.counter("inbox_duplicates_total", &labels), 1);
    assert_eq!(first.counter("inbox_retried_total", &labels), 1);
    assert_eq!(
        first.counter(
            "inbox_dead_lettered_total",
            &[("group", GROUP), ("reason", "permanent")]
        ),
        1
    );
    // One optimistic transaction, rerun isolated after the failures: one commit timed.
    assert_eq!(first.samples("inbox_batch_commit_seconds", &labels), 1);

    // The same key with another payload: a collision, counted twice over (as such,
    // and among the dead letters by reason); a copy of a done message, a duplicate.
    std::thread::sleep(Duration::from_millis(2));
    let (decisions, second) = capture(|| {
        store
            .process_batch(&g, &[usage("a", 99), usage("b", 2), usage("flaky", 3)])
            .unwrap()
    });
    assert_eq!(
        decisions,
        [
            Decision::DeadLettered(DeadLetterReason::KeyCollision),
            Decision::Duplicate,
            Decision::DeadLettered(DeadLetterReason::MaxAttempts),
        ]
    );
    assert_eq!(second.counter("inbox_key_collisions_total", &labels), 1);
    assert_eq!(second.counter("inbox_duplicates_total", &labels), 1);
    for (reason, n) in [("key_collision", 1), ("max_attempts", 1), ("permanent", 0)] {
        assert_eq!(
            second.counter(
                "inbox_dead_lettered_total",
                &[("group", GROUP), ("reason", reason)]
            ),
            n,
            "{reason}"
        );
    }
    assert_eq!(second.counter("inbox_processed_total", &labels), 0);
    assert_eq!(fx.connect().effects_of("a").unwrap(), 1);
}
