//! What the store reports: counters through the `metrics` facade, counted per outcome
//! and group, which must move exactly with the decisions; and a `tracing` span per
//! batch and per delivery (group, key, attempt, outcome).

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::time::Duration;

use inbox_core::{DeadLetterReason, Decision, RetryPolicy};
use inbox_test_support::metrics::capture;
use inbox_test_support::{group, usage, Fixture, Outcome, Recorder, TestConn};

const GROUP: &str = "billing.daily-usage";

inbox_test_support::on_both_backends!(
    counters_follow_the_decisions,
    a_span_per_delivery_with_its_attempt_and_outcome,
);

fn counters_follow_the_decisions<F: Fixture>(fx: &F) {
    let policy = RetryPolicy::new(2, Duration::from_millis(1), Duration::from_millis(1)).unwrap();
    let handler = Recorder::new(GROUP)
        .policy(policy)
        .behaviour(|key, _| match key {
            k if k.starts_with("flaky") => Outcome::ApplyThenFail,
            k if k.starts_with("invalid") => Outcome::Permanent,
            _ => Outcome::Apply,
        });
    let store = fx.open(fx.builder().handler(handler));
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
                    usage("invalid-too", 5),
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
            Decision::DeadLettered(DeadLetterReason::Permanent),
        ]
    );
    assert_eq!(first.counter("inbox_key_collisions_total", &labels), 0);
    assert_eq!(first.counter("inbox_processed_total", &labels), 2);
    assert_eq!(first.counter("inbox_duplicates_total", &labels), 1);
    assert_eq!(first.counter("inbox_retried_total", &labels), 1);
    assert_eq!(
        first.counter(
            "inbox_dead_lettered_total",
            &[("group", GROUP), ("reason", "permanent")]
        ),
        2
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

fn a_span_per_delivery_with_its_attempt_and_outcome<F: Fixture>(fx: &F) {
    let policy = RetryPolicy::new(4, Duration::from_millis(1), Duration::from_millis(1)).unwrap();
    let handler = Recorder::new(GROUP)
        .policy(policy)
        .behaviour(|key, _| match key {
            "flaky" => Outcome::ApplyThenFail,
            _ => Outcome::Apply,
        });
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    store.process_batch(&g, &[usage("flaky", 1)]).unwrap();
    std::thread::sleep(Duration::from_millis(2));

    let (_, spans) = inbox_test_support::spans::capture(|| {
        store
            .process_batch(&g, &[usage("a", 1), usage("a", 1), usage("flaky", 1)])
            .unwrap()
    });
    let batch: Vec<_> = spans.iter().filter(|s| s.name == "inbox.batch").collect();
    assert_eq!(batch.len(), 1, "{spans:#?}");
    assert_eq!(batch[0].fields["size"], "3");
    let deliveries: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "inbox.delivery")
        .collect();
    assert_eq!(deliveries.len(), 3, "one per delivery: {spans:#?}");
    let field = |i: usize, name: &str| deliveries[i].fields.get(name).cloned();
    for (i, key, attempt, outcome) in [
        (0, "a", Some("1"), "Processed"),
        // The second copy of a key in the batch is never claimed: no attempt.
        (1, "a", None, "Duplicate"),
        // Second attempt, failed again: retried after the policy's next delay.
        (2, "flaky", Some("2"), "RetryAfter"),
    ] {
        assert_eq!(deliveries[i].parent, Some("inbox.batch"));
        assert_eq!(field(i, "group").as_deref(), Some(GROUP));
        assert_eq!(field(i, "key").as_deref(), Some(key));
        assert_eq!(field(i, "attempt").as_deref(), attempt, "{key}");
        let found = field(i, "outcome").unwrap_or_default();
        assert!(found.starts_with(outcome), "{key}: {found}");
    }
}
