//! The inbox state machine against real PostgreSQL and SQLite: one schema or file per
//! test, time driven by a manual clock, assertions on stored values.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::{Arc, Barrier};
use std::time::Duration;

use inbox_core::{
    ClaimKey, Clock, DeadLetterOutcome, DeadLetterReason, Decision, Envelope, InboxStore,
    ManualClock, MessageKey, RetryLadder, RetryPolicy,
};
use inbox_diesel::ClaimStatus;
use inbox_test_support::{claim_key, start_time};
use inbox_test_support::{
    group, usage, Fixture, Outcome, PgFixture, Recorder, SqliteFixture, TestConn,
};

const GROUP: &str = "billing.daily-usage";

fn key(k: &str) -> ClaimKey {
    claim_key(GROUP, k)
}

inbox_test_support::on_both_backends!(
    processes_once_and_acks_duplicates,
    failures_advance_attempts_then_dead_letter_once,
    first_failure_of_a_new_message_is_recorded,
    permanent_error_dead_letters_at_once,
    panics_are_failures_and_the_rest_commits,
    key_collision_after_success,
    key_collision_while_awaiting_retry,
    key_repeated_in_one_batch,
    batch_of_100_with_3_failures,
    undecodable_payload_is_dead_lettered,
    type_without_handler_is_dead_lettered,
    retry_after_overrides_the_policy,
    retry_ladder_records_the_delay_actually_used,
    broker_dead_letters_mark_the_claim_dead,
    fold_is_used_and_falls_back_per_event_on_failure,
);

fn processes_once_and_acks_duplicates<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));

    let g = group(GROUP);
    assert_eq!(
        store.process_batch(&g, &[usage("a", 40)]).unwrap(),
        [Decision::Processed]
    );
    assert_eq!(
        store.process_batch(&g, &[usage("a", 40)]).unwrap(),
        [Decision::Duplicate]
    );
    assert_eq!(
        store
            .process_batch(&g, &[usage("a", 40).redelivered()])
            .unwrap(),
        [Decision::Duplicate]
    );
    assert_eq!(calls.lock().unwrap().len(), 1);
    assert_eq!(fx.connect().effects_of("a").unwrap(), 1);
    let claim = store.claim_record(&key("a")).unwrap().expect("claim");
    assert_eq!(
        (claim.status, claim.attempts, claim.starts),
        (ClaimStatus::Done, 0, 0)
    );
    assert!(!claim.has_payload, "a done claim keeps no payload");

    // Another group's claim of the same key is independent.
    let other = Recorder::new("billing.other");
    let other_store = fx.builder().handler(other).build().expect("store");
    assert_eq!(
        other_store
            .process_batch(&group("billing.other"), &[usage("a", 40)])
            .unwrap(),
        [Decision::Processed]
    );
}

fn failures_advance_attempts_then_dead_letter_once<F: Fixture>(fx: &F) {
    let clock = ManualClock::new(start_time());
    let policy = RetryPolicy::new(4, Duration::from_secs(10), Duration::from_secs(25)).unwrap();
    let handler = Recorder::new(GROUP)
        .policy(policy)
        .behaviour(|_, _| Outcome::ApplyThenFail);
    let calls = handler.calls();
    let store = fx.open(fx.builder().clock(Arc::new(clock.clone())).handler(handler));
    let g = group(GROUP);
    let msg = usage("poison", 5).with_tenant("acme");

    let expected_delays = [10, 20, 25];
    for attempt in 1..=3 {
        let now = clock.now();
        let decision = store.process_batch(&g, std::slice::from_ref(&msg)).unwrap();
        let delay = Duration::from_secs(expected_delays[attempt - 1]);
        assert_eq!(decision, [Decision::RetryAfter(delay)], "attempt {attempt}");
        let claim = store.claim_record(&key("poison")).unwrap().expect("claim");
        assert_eq!(claim.attempts, attempt as i32);
        assert_eq!(claim.status, ClaimStatus::Failed);
        assert_eq!(
            claim.next_attempt_at,
            Some(now + chrono::Duration::from_std(delay).unwrap())
        );
        assert!(
            claim.has_payload,
            "a failed claim keeps its payload for redrive"
        );
        assert_eq!(claim.tenant.as_deref(), Some("acme"));
        assert!(claim
            .last_error
            .unwrap()
            .contains("poison failed after writing"));

        // Before next_attempt_at: the handler does not run.
        clock.advance(delay - Duration::from_secs(1));
        assert_eq!(
            store.process_batch(&g, std::slice::from_ref(&msg)).unwrap(),
            [Decision::RetryAfter(Duration::from_secs(1))]
        );
        assert_eq!(calls.lock().unwrap().len(), attempt);
        clock.advance(Duration::from_secs(1));
    }

    let decision = store.process_batch(&g, std::slice::from_ref(&msg)).unwrap();
    assert_eq!(
        decision,
        [Decision::DeadLettered(DeadLetterReason::MaxAttempts)]
    );
    let claim = store.claim_record(&key("poison")).unwrap().expect("claim");
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Dead, 4));
    assert_eq!(calls.lock().unwrap().len(), 4);

    // Later deliveries, redelivered or not, do not run the handler or dead-letter again.
    clock.advance(Duration::from_secs(3600));
    for again in [msg.clone(), msg.clone().redelivered()] {
        assert_eq!(
            store.process_batch(&g, &[again]).unwrap(),
            [Decision::AlreadyDeadLettered]
        );
    }
    assert_eq!(calls.lock().unwrap().len(), 4);

    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1, "dead-lettered exactly once");
    assert_eq!(dead[0].reason, inbox_core::DeadLetterReason::MaxAttempts);
    assert_eq!(dead[0].attempts, 4);
    assert_eq!(dead[0].payload, msg.payload);
    assert_eq!(dead[0].tenant.as_deref(), Some("acme"));
    assert!(dead[0]
        .last_error
        .as_deref()
        .unwrap()
        .contains("poison failed after writing"));
    // Every failed attempt's write was rolled back with its savepoint.
    assert_eq!(fx.connect().effects_of("poison").unwrap(), 0);
}

fn first_failure_of_a_new_message_is_recorded<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP).behaviour(|_, _| Outcome::ApplyThenFail);
    let store = fx.open(fx.builder().handler(handler));
    let decision = store
        .process_batch(&group(GROUP), &[usage("new", 1)])
        .unwrap();
    assert!(matches!(decision[..], [Decision::RetryAfter(_)]));
    // The claim was inserted in the same transaction as the handler's savepoint; it
    // survives the savepoint's rollback.
    let claim = store
        .claim_record(&key("new"))
        .unwrap()
        .expect("the claim survives");
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Failed, 1));
    assert_eq!(fx.connect().effects_of("new").unwrap(), 0);
}

fn permanent_error_dead_letters_at_once<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP).behaviour(|_, _| Outcome::Permanent);
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    assert_eq!(
        store.process_batch(&g, &[usage("bad", 1)]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::Permanent)]
    );
    let claim = store.claim_record(&key("bad")).unwrap().expect("claim");
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Dead, 1));
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, inbox_core::DeadLetterReason::Permanent);
    assert_eq!(dead[0].last_error.as_deref(), Some("bad is invalid"));
}

fn panics_are_failures_and_the_rest_commits<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP).behaviour(|key, _| match key {
        "boom" => Outcome::Panic,
        "nested" => Outcome::PanicInNestedTransaction,
        _ => Outcome::Apply,
    });
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    let batch = [
        usage("a", 1),
        usage("boom", 1),
        usage("nested", 1),
        usage("z", 1),
    ];
    let decisions = store.process_batch(&g, &batch).unwrap();
    assert_eq!(decisions[0], Decision::Processed);
    assert!(matches!(decisions[1], Decision::RetryAfter(_)));
    assert!(matches!(decisions[2], Decision::RetryAfter(_)));
    assert_eq!(decisions[3], Decision::Processed);

    // Check from a second connection that the rest of the batch really committed.
    let mut other = fx.connect();
    assert_eq!(other.effects_of("a").unwrap(), 1);
    assert_eq!(other.effects_of("z").unwrap(), 1);
    assert_eq!(other.effects_of("boom").unwrap(), 0);
    assert_eq!(other.effects_of("nested").unwrap(), 0);
    for k in ["boom", "nested"] {
        let claim = store.claim_record(&key(k)).unwrap().expect("claim");
        assert_eq!(
            (claim.status, claim.attempts),
            (ClaimStatus::Failed, 1),
            "{k}"
        );
        // The panic's own message is kept, so an operator sees why.
        let last_error = claim.last_error.unwrap();
        assert!(last_error.contains("panicked"), "{last_error}");
        assert!(last_error.contains(k), "{last_error}");
    }
    // The pooled connections are usable afterwards: the process keeps going.
    for i in 0..8 {
        let k = format!("after-{i}");
        assert_eq!(
            store.process_batch(&g, &[usage(&k, 1)]).unwrap(),
            [Decision::Processed]
        );
    }
    assert_eq!(other.effect_count().unwrap(), 10);
}

fn key_collision_after_success<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    assert_eq!(
        store.process_batch(&g, &[usage("k", 1)]).unwrap(),
        [Decision::Processed]
    );
    for delivery in [usage("k", 2), usage("k", 2).redelivered()] {
        assert_eq!(
            store.process_batch(&g, &[delivery]).unwrap(),
            [Decision::DeadLettered(DeadLetterReason::KeyCollision)]
        );
    }
    assert_eq!(calls.lock().unwrap().len(), 1);
    let claim = store.claim_record(&key("k")).unwrap().expect("claim");
    assert_eq!(
        claim.status,
        ClaimStatus::Done,
        "the stored claim is untouched"
    );
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 2);
    assert!(dead
        .iter()
        .all(|d| d.reason == inbox_core::DeadLetterReason::KeyCollision));
    assert_eq!(dead[0].payload, usage("k", 2).payload);
}

fn key_collision_while_awaiting_retry<F: Fixture>(fx: &F) {
    let clock = ManualClock::new(start_time());
    let handler = Recorder::new(GROUP).behaviour(|_, ctx| {
        if ctx.attempt() == 1 {
            Outcome::ApplyThenFail
        } else {
            Outcome::Apply
        }
    });
    let calls = handler.calls();
    let store = fx.open(fx.builder().clock(Arc::new(clock.clone())).handler(handler));
    let g = group(GROUP);
    assert!(matches!(
        store.process_batch(&g, &[usage("k", 1)]).unwrap()[..],
        [Decision::RetryAfter(_)]
    ));
    // Due or not, another body never runs under the first one's claim.
    for wait in [0, 3600] {
        clock.advance(Duration::from_secs(wait));
        assert_eq!(
            store.process_batch(&g, &[usage("k", 99)]).unwrap(),
            [Decision::DeadLettered(DeadLetterReason::KeyCollision)]
        );
    }
    assert_eq!(calls.lock().unwrap().len(), 1);
    let claim = store.claim_record(&key("k")).unwrap().expect("claim");
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Failed, 1));
    // The original is still retried and applied once.
    assert_eq!(
        store.process_batch(&g, &[usage("k", 1)]).unwrap(),
        [Decision::Processed]
    );
    assert_eq!(fx.connect().effects_of("k").unwrap(), 1);
}

fn key_repeated_in_one_batch<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    let batch = [
        usage("k", 1),
        usage("other", 1),
        usage("k", 1),
        usage("k", 7),
    ];
    let decisions = store.process_batch(&g, &batch).unwrap();
    assert_eq!(
        decisions,
        [
            Decision::Processed,
            Decision::Processed,
            Decision::Duplicate,
            Decision::DeadLettered(DeadLetterReason::KeyCollision),
        ]
    );
    assert_eq!(calls.lock().unwrap().len(), 2, "claimed and handled once");
    assert_eq!(fx.connect().effects_of("k").unwrap(), 1);
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].payload, usage("k", 7).payload);
}

fn batch_of_100_with_3_failures<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if ["m-013", "m-050", "m-087"].contains(&key) {
            Outcome::ApplyThenFail
        } else {
            Outcome::Apply
        }
    });
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    let batch: Vec<Envelope> = (0..100).map(|i| usage(&format!("m-{i:03}"), 1)).collect();
    let decisions = store.process_batch(&g, &batch).unwrap();
    assert_eq!(decisions.len(), 100);
    let retried: Vec<usize> = decisions
        .iter()
        .enumerate()
        .filter(|(_, d)| matches!(d, Decision::RetryAfter(_)))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(retried, [13, 50, 87]);
    assert_eq!(
        decisions
            .iter()
            .filter(|d| **d == Decision::Processed)
            .count(),
        97
    );
    assert_eq!(fx.connect().effect_count().unwrap(), 97);
    for k in ["m-013", "m-050", "m-087"] {
        assert_eq!(store.claim_record(&key(k)).unwrap().unwrap().attempts, 1);
    }
    // The optimistic run stops at the first failure (m-013, the 14th key in key
    // order); the isolated run records that known failure without calling its handler
    // again and calls the 99 others once each, with a savepoint each.
    assert_eq!(calls.lock().unwrap().len(), 14 + 99);
}

fn undecodable_payload_is_dead_lettered<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    let bad = Envelope::new(
        MessageKey::new("garbled").unwrap(),
        "usage.recorded",
        b"{not json".to_vec(),
    );
    let decisions = store
        .process_batch(&g, &[usage("fine", 1), bad.clone()])
        .unwrap();
    assert_eq!(
        decisions,
        [
            Decision::Processed,
            Decision::DeadLettered(DeadLetterReason::DecodeError)
        ]
    );
    assert_eq!(
        calls.lock().unwrap().len(),
        1,
        "the handler never sees the bad body"
    );
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, inbox_core::DeadLetterReason::DecodeError);
    assert_eq!(dead[0].payload, bad.payload, "nothing is lost");
    assert!(dead[0]
        .last_error
        .as_deref()
        .unwrap()
        .contains("does not decode"));
}

fn type_without_handler_is_dead_lettered<F: Fixture>(fx: &F) {
    let store = fx.open(fx.builder().handler(Recorder::new(GROUP)));
    let g = group(GROUP);
    let mut env = usage("x", 1);
    env.message_type = "usage.unknown".into();
    assert_eq!(
        store.process_batch(&g, &[env.clone()]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::NoHandler)]
    );
    assert_eq!(
        store.process_batch(&g, &[env]).unwrap(),
        [Decision::AlreadyDeadLettered]
    );
    assert_eq!(store.dead_letters(&g).unwrap().len(), 1);
}

fn retry_after_overrides_the_policy<F: Fixture>(fx: &F) {
    struct Later(inbox_core::ConsumerGroup);
    impl<C: TestConn + Send + 'static> inbox_core::Handler<C> for Later {
        type Message = inbox_test_support::Usage;
        fn group(&self) -> &inbox_core::ConsumerGroup {
            &self.0
        }
        fn message_type(&self) -> &str {
            "usage.recorded"
        }
        fn handle(
            &self,
            _: &mut C,
            _: Self::Message,
            _: &inbox_core::MessageContext<'_>,
        ) -> Result<(), inbox_core::HandlerError> {
            Err(inbox_core::HandlerError::retry_after(
                Duration::from_secs(42),
                "rate limited",
            ))
        }
    }
    let clock = ManualClock::new(start_time());
    let store = fx
        .builder()
        .clock(Arc::new(clock.clone()))
        .handler(Later(group(GROUP)))
        .build()
        .expect("store");
    assert_eq!(
        store
            .process_batch(&group(GROUP), &[usage("k", 1)])
            .unwrap(),
        [Decision::RetryAfter(Duration::from_secs(42))]
    );
    let claim = store.claim_record(&key("k")).unwrap().unwrap();
    assert_eq!(
        claim.next_attempt_at,
        Some(start_time() + chrono::Duration::seconds(42))
    );
}

/// `threads` threads deliver the same envelope at once: one processes it, the rest
/// see a duplicate, the effect happens once.
fn threads_deliver_the_same_envelope<F: Fixture>(fx: &F, threads: usize) {
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(fx.builder().pool_size(threads as u32).handler(handler));
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let store = store.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                store
                    .process_batch(&group(GROUP), &[usage("same", 40)])
                    .unwrap()
            })
        })
        .collect();
    let decisions: Vec<Decision> = handles
        .into_iter()
        .flat_map(|t| t.join().expect("thread"))
        .collect();
    let count = |want: Decision| decisions.iter().filter(|d| **d == want).count();
    assert_eq!(count(Decision::Processed), 1, "{decisions:?}");
    assert_eq!(count(Decision::Duplicate), threads - 1, "{decisions:?}");
    assert_eq!(calls.lock().unwrap().len(), 1);
    assert_eq!(fx.connect().effects_of("same").unwrap(), 1);
}

#[test]
fn thirty_two_threads_deliver_the_same_envelope() {
    let Some(fx) = PgFixture::new() else { return };
    threads_deliver_the_same_envelope(&fx, 32);
}

#[test]
fn sqlite_threads_deliver_the_same_envelope() {
    threads_deliver_the_same_envelope(&SqliteFixture::new(), 8);
}

fn retry_ladder_records_the_delay_actually_used<F: Fixture>(fx: &F) {
    let ms = Duration::from_millis;
    let clock = ManualClock::new(start_time());
    let policy = RetryPolicy::new(5, ms(60), ms(1000)).unwrap();
    let handler = Recorder::new(GROUP)
        .policy(policy)
        .behaviour(|_, _| Outcome::ApplyThenFail);
    let store = fx.open(
        fx.builder()
            .clock(Arc::new(clock.clone()))
            .retry_ladder(RetryLadder::new([ms(50), ms(100), ms(200)]).unwrap())
            .handler(handler),
    );
    let g = group(GROUP);
    // Policy delays 60, 120, 240 ms wait in the 100, 200 and (longest) 200 ms tiers.
    for tier in [100, 200, 200] {
        let now = clock.now();
        let decision = store.process_batch(&g, &[usage("k", 1)]).unwrap();
        assert_eq!(decision, [Decision::RetryAfter(ms(tier))]);
        let claim = store.claim_record(&key("k")).unwrap().unwrap();
        assert_eq!(
            claim.next_attempt_at,
            Some(now + chrono::Duration::milliseconds(tier as i64))
        );
        clock.advance(ms(tier));
    }
}

fn broker_dead_letters_mark_the_claim_dead<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "failing" {
            Outcome::ApplyThenFail
        } else {
            Outcome::Apply
        }
    });
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    store
        .process_batch(&g, &[usage("done", 1), usage("failing", 1)])
        .unwrap();
    let limit = |env: &Envelope| {
        store.dead_letter(
            &g,
            env,
            DeadLetterReason::DeliveryLimit,
            "x-delivery-limit reached",
        )
    };

    // A message still awaiting a retry: dead letter and dead claim, together.
    assert_eq!(
        limit(&usage("failing", 1)).unwrap(),
        DeadLetterOutcome::Recorded
    );
    assert_eq!(
        store.claim_record(&key("failing")).unwrap().unwrap().status,
        ClaimStatus::Dead
    );
    assert_eq!(
        limit(&usage("failing", 1)).unwrap(),
        DeadLetterOutcome::AlreadyDead
    );
    // A message whose effect happened is not dead-lettered.
    assert_eq!(
        limit(&usage("done", 1)).unwrap(),
        DeadLetterOutcome::AlreadyDone
    );
    // A message never claimed gets a dead claim, so later copies are not run.
    assert_eq!(
        limit(&usage("unseen", 1)).unwrap(),
        DeadLetterOutcome::Recorded
    );
    assert_eq!(
        store.process_batch(&g, &[usage("unseen", 1)]).unwrap(),
        [Decision::AlreadyDeadLettered]
    );
    // A malformed delivery's made-up key gets a dead letter and no claim.
    let malformed = usage("made-up", 1);
    assert_eq!(
        store
            .dead_letter(&g, &malformed, DeadLetterReason::Malformed, "no message_id")
            .unwrap(),
        DeadLetterOutcome::Recorded
    );
    assert_eq!(store.claim_record(&key("made-up")).unwrap(), None);

    let reasons: Vec<(String, DeadLetterReason)> = store
        .dead_letters(&g)
        .unwrap()
        .into_iter()
        .map(|d| (d.key, d.reason))
        .collect();
    assert_eq!(
        reasons,
        [
            ("failing".into(), DeadLetterReason::DeliveryLimit),
            ("unseen".into(), DeadLetterReason::DeliveryLimit),
            ("made-up".into(), DeadLetterReason::Malformed),
        ]
    );
    assert_eq!(
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|k| *k == "unseen")
            .count(),
        0
    );
}

/// Sums a batch into one write per key; fails the whole fold on a negative amount.
struct Folding {
    group: inbox_core::ConsumerGroup,
    folds: Arc<std::sync::Mutex<Vec<usize>>>,
    handled: Arc<std::sync::Mutex<Vec<String>>>,
}

impl<C: TestConn + Send + 'static> inbox_core::Handler<C> for Folding {
    type Message = inbox_test_support::Usage;

    fn group(&self) -> &inbox_core::ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        "usage.recorded"
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: Self::Message,
        ctx: &inbox_core::MessageContext<'_>,
    ) -> Result<(), inbox_core::HandlerError> {
        self.handled
            .lock()
            .unwrap()
            .push(ctx.message_key().to_string());
        if msg.amount < 0 {
            return Err(inbox_core::HandlerError::transient("negative amount"));
        }
        conn.record_effect(ctx.message_key().as_str(), msg.amount)?;
        Ok(())
    }

    fn fold(
        &self,
        conn: &mut C,
        batch: &[(Self::Message, inbox_core::MessageContext<'_>)],
    ) -> Option<Result<(), inbox_core::HandlerError>> {
        self.folds.lock().unwrap().push(batch.len());
        if batch.iter().any(|(m, _)| m.amount < 0) {
            return Some(Err(inbox_core::HandlerError::transient(
                "negative amount in batch",
            )));
        }
        // One write for the whole batch (keys joined), to prove the fold ran.
        let keys: Vec<&str> = batch
            .iter()
            .map(|(_, c)| c.message_key().as_str())
            .collect();
        let total = batch.iter().map(|(m, _)| m.amount).sum();
        Some(
            conn.record_effect(&keys.join(","), total)
                .map_err(Into::into),
        )
    }
}

fn fold_is_used_and_falls_back_per_event_on_failure<F: Fixture>(fx: &F) {
    let folds = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handled = Arc::new(std::sync::Mutex::new(Vec::new()));
    let store = fx.open(fx.builder().handler(Folding {
        group: group(GROUP),
        folds: Arc::clone(&folds),
        handled: Arc::clone(&handled),
    }));
    let g = group(GROUP);

    let clean: Vec<Envelope> = (0..10).map(|i| usage(&format!("a{i}"), 2)).collect();
    let decisions = store.process_batch(&g, &clean).unwrap();
    assert!(decisions.iter().all(|d| *d == Decision::Processed));
    assert_eq!(*folds.lock().unwrap(), [10], "one fold for the batch");
    assert!(handled.lock().unwrap().is_empty(), "no per-event calls");
    assert_eq!(fx.connect().effect_count().unwrap(), 1, "one write");

    let mut poisoned: Vec<Envelope> = (0..10).map(|i| usage(&format!("b{i}"), 2)).collect();
    poisoned[4] = usage("b4", -1);
    let decisions = store.process_batch(&g, &poisoned).unwrap();
    assert_eq!(*folds.lock().unwrap(), [10, 10], "the fold ran and failed");
    assert_eq!(
        handled.lock().unwrap().len(),
        10,
        "then one handle per event"
    );
    assert!(matches!(decisions[4], Decision::RetryAfter(_)));
    assert_eq!(
        decisions
            .iter()
            .filter(|d| **d == Decision::Processed)
            .count(),
        9
    );
    let mut conn = fx.connect();
    assert_eq!(
        conn.effect_count().unwrap(),
        1 + 9,
        "the failed fold's write was rolled back"
    );
    assert_eq!(conn.effects_of("b4").unwrap(), 0);
}

thread_local! {
    /// Statements this thread's diesel connections sent (see [`count_round_trips`]).
    static SENT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts, per thread, the statements of every diesel connection opened from now on:
/// one per round trip (several statements sent as one string are one). A store runs
/// a batch on the caller's thread, so other tests of this binary do not disturb it.
fn count_round_trips() {
    use diesel::connection::{Instrumentation, InstrumentationEvent};
    struct Count;
    impl Instrumentation for Count {
        fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
            if let InstrumentationEvent::StartQuery { .. } = event {
                SENT.with(|s| s.set(s.get() + 1));
            }
        }
    }
    diesel::connection::set_default_instrumentation(|| Some(Box::new(Count))).unwrap();
}

/// The per-message path on PostgreSQL: a lone first delivery costs the store three
/// round trips besides its handler's statement (BEGIN with the handlers' savepoint;
/// the claim, which also reads the transaction token; the check of the handler's
/// call with the COMMIT), and a duplicate four (its claim looked up by the claim key).
#[test]
fn a_lone_delivery_takes_three_round_trips_besides_its_handler() {
    let Some(fx) = PgFixture::new() else { return };
    count_round_trips();
    let store = fx.open(fx.builder().pool_size(1).handler(Recorder::new(GROUP)));
    let g = group(GROUP);
    // The first batch prepares the connection's cached statements.
    store.process_batch(&g, &[usage("warm", 1)]).unwrap();
    let sent = || SENT.with(std::cell::Cell::get);
    let before = sent();
    let first = store.process_batch(&g, &[usage("first", 1)]).unwrap();
    let first_trips = sent() - before;
    let before = sent();
    let again = store.process_batch(&g, &[usage("first", 1)]).unwrap();
    let duplicate_trips = sent() - before;
    assert_eq!(
        (first, again),
        (vec![Decision::Processed], vec![Decision::Duplicate])
    );
    assert_eq!(
        (first_trips, duplicate_trips),
        (1 + 3, 4),
        "round trips of a first delivery (its handler's statement and the store's) and of a duplicate"
    );
    assert_eq!(fx.connect().effects_of("first").unwrap(), 1);
}
