//! The claim path under attack: careless handlers, impostor copies, bytes the store
//! cannot hold, errors that never heal, store errors after a start mark, absurd
//! delays. Each test failed on the code before its guard.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::TimeDelta;
use diesel::result::DatabaseErrorKind;
use inbox_core::{
    ClaimKey, DeadLetterReason, Decision, Envelope, InboxStore, ManualClock, MessageKey,
    ProjectionLock, RetryPolicy, MAX_RETRY_DELAY,
};
use inbox_diesel::{Backend, ClaimStatus, Store};
use inbox_test_support::{all_stop, claim_key, start_time};
use inbox_test_support::{group, usage, Fixture, Outcome, PgFixture, Recorder, TestConn};

const GROUP: &str = "billing.daily-usage";

fn key(k: &str) -> ClaimKey {
    claim_key(GROUP, k)
}

inbox_test_support::on_both_backends!(
    a_swallowed_database_error_is_a_recorded_failure_never_an_ack,
    copies_are_judged_against_the_stored_claim_not_the_first_copy,
    nul_bytes_are_dead_lettered_malformed_and_batch_mates_go_on,
    a_data_error_on_the_stores_statements_splits_the_batch,
    contention_inside_a_handler_counts_once_the_free_reruns_are_spent,
    a_huge_retry_delay_saturates_instead_of_panicking,
    data_errors_raised_by_a_handler_are_permanent,
    a_long_error_is_cut_on_a_char_boundary,
    dead_letters_keep_the_delivery_headers,
    each_message_type_in_a_batch_reaches_its_own_handler,
    a_broker_dead_letter_of_another_payload_is_recorded_and_the_claim_untouched,
);

/// PostgreSQL aborts the transaction at the first failing statement, and `COMMIT`
/// then silently rolls back: the message must be a recorded failure, isolated from its
/// batch-mates, never `Processed`. SQLite keeps the transaction usable, so there the
/// effect rightly commits.
fn a_swallowed_database_error_is_a_recorded_failure_never_an_ack<F: Fixture>(fx: &F) {
    let clock = ManualClock::new(start_time());
    let bad = if fx.builder().build().unwrap().backend() == Backend::Postgres {
        "SELECT 1/0"
    } else {
        "INSERT INTO no_such_table VALUES (1)"
    };
    let handler = Recorder::new(GROUP).behaviour(move |key, ctx| {
        if key.starts_with("swallow") && ctx.attempt() == 1 {
            Outcome::IgnoreSql(bad)
        } else {
            Outcome::Apply
        }
    });
    let store = fx
        .builder()
        .clock(Arc::new(clock.clone()))
        .handler(handler)
        .build()
        .unwrap();
    let postgres = store.backend() == Backend::Postgres;
    fx.connect().create_effects().unwrap();
    let g = group(GROUP);
    for batch in [
        vec![usage("swallow-alone", 1)],
        vec![usage("ok-1", 1), usage("swallow-mid", 1), usage("ok-2", 1)],
        // Claims and calls go in key order: here the swallowing call comes first, and
        // its batch-mate's first statement fails for it; only the swallower is blamed.
        vec![usage("swallow-first", 1), usage("z-after", 1)],
    ] {
        let decisions = store.process_batch(&g, &batch).unwrap();
        for (env, decision) in batch.iter().zip(&decisions) {
            let k = env.message_key.as_str();
            let mut conn = fx.connect();
            if k.starts_with("swallow") && postgres {
                assert!(
                    matches!(decision, Decision::RetryAfter(_)),
                    "{k}: {decision:?}"
                );
                assert_eq!(conn.effects_of(k).unwrap(), 0, "{k}");
                let claim = store.claim(&key(k)).unwrap().expect("claim");
                assert_eq!((claim.status, claim.attempts), (ClaimStatus::Failed, 1));
                assert!(claim
                    .last_error
                    .unwrap()
                    .contains("database error it did not propagate"));
            } else {
                assert_eq!(decision, &Decision::Processed, "{k}");
                assert_eq!(conn.effects_of(k).unwrap(), 1, "{k}");
            }
        }
    }
    if postgres {
        // The retry applies it, once.
        clock.advance(Duration::from_secs(3600));
        let retry = [
            usage("swallow-alone", 1),
            usage("swallow-mid", 1),
            usage("swallow-first", 1),
        ];
        assert_eq!(
            store.process_batch(&g, &retry).unwrap(),
            [
                Decision::Processed,
                Decision::Processed,
                Decision::Processed
            ]
        );
        assert_eq!(fx.connect().effects_of("swallow-mid").unwrap(), 1);
    }
}

/// A handler that commits, rolls back or restarts the store's transaction itself has
/// already committed (or lost) its batch-mates' claims: nothing can be isolated, the
/// group stops, naming the handler.
#[test]
fn a_handler_that_ends_the_stores_transaction_stops_the_group() {
    for sql in ["COMMIT", "COMMIT; BEGIN", "ROLLBACK", "ROLLBACK; BEGIN"] {
        let Some(fx) = PgFixture::new() else { return };
        let handler = Recorder::new(GROUP).behaviour(move |key, _| {
            if key.starts_with("rogue") {
                Outcome::IgnoreSql(sql)
            } else {
                Outcome::Apply
            }
        });
        let store = fx.open(fx.builder().handler(handler));
        let g = group(GROUP);
        for batch in [
            vec![usage("rogue-alone", 1)],
            vec![usage("a", 1), usage("rogue-mid", 1), usage("b", 1)],
        ] {
            let decisions = store.process_batch(&g, &batch).unwrap();
            assert!(all_stop(&decisions), "{sql}: {decisions:?}");
            let Decision::Stop(violation) = &decisions[0] else {
                unreachable!()
            };
            assert!(
                violation
                    .detail
                    .contains("billing.daily-usage/usage.recorded"),
                "{sql}: {violation:?}"
            );
        }
        // The store's connections are still usable afterwards.
        let decisions = store.process_batch(&g, &[usage("later", 1)]).unwrap();
        assert_eq!(decisions, [Decision::Processed], "{sql}");
    }
}

/// Claim K is failed and due; one batch holds K with another payload first, then K
/// with its own: the impostor is a collision, the real retry is processed (and after
/// a success, a duplicate).
fn copies_are_judged_against_the_stored_claim_not_the_first_copy<F: Fixture>(fx: &F) {
    let clock = ManualClock::new(start_time());
    let handler = Recorder::new(GROUP).behaviour(|key, ctx| {
        if key == "k" && ctx.attempt() == 1 {
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
    clock.advance(Duration::from_secs(3600));
    let batch = [usage("k", 2), usage("k", 1)];
    assert_eq!(
        store.process_batch(&g, &batch).unwrap(),
        [
            Decision::DeadLettered(DeadLetterReason::KeyCollision),
            Decision::Processed
        ]
    );
    assert_eq!(
        store.process_batch(&g, &batch).unwrap(),
        [
            Decision::DeadLettered(DeadLetterReason::KeyCollision),
            Decision::Duplicate
        ]
    );
    assert_eq!(fx.connect().effects_of("k").unwrap(), 1);
    assert_eq!(calls.lock().unwrap().len(), 2);
    calls.lock().unwrap().clear();
    // A new key: the first copy owns it, an identical copy is a duplicate, another
    // body is a collision against what the first copy stored.
    let batch = [usage("n", 5), usage("n", 5), usage("n", 6)];
    assert_eq!(
        store.process_batch(&g, &batch).unwrap(),
        [
            Decision::Processed,
            Decision::Duplicate,
            Decision::DeadLettered(DeadLetterReason::KeyCollision)
        ]
    );
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 3);
    assert!(dead.iter().all(|d| d.reason == "key_collision"));
}

fn with_type(env: Envelope, message_type: &str) -> Envelope {
    Envelope {
        message_type: message_type.to_owned(),
        ..env
    }
}

/// PostgreSQL's TEXT rejects the NUL byte: such a delivery failed every statement of
/// its batch, forever. It is dead-lettered as `malformed` (escaped, the raw values
/// kept in headers) while its batch-mates are processed.
fn nul_bytes_are_dead_lettered_malformed_and_batch_mates_go_on<F: Fixture>(fx: &F) {
    let store = fx.open(fx.builder().handler(Recorder::new(GROUP)));
    let g = group(GROUP);
    let batch = [
        usage("a", 1),
        with_type(usage("nul-type", 1), "usage\0recorded"),
        usage("nul-tenant", 1).with_tenant("acme\0"),
        usage("b", 1),
    ];
    assert_eq!(
        store.process_batch(&g, &batch).unwrap(),
        [
            Decision::Processed,
            Decision::DeadLettered(DeadLetterReason::Malformed),
            Decision::DeadLettered(DeadLetterReason::Malformed),
            Decision::Processed
        ]
    );
    assert_eq!(fx.connect().effect_count().unwrap(), 2);
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 2);
    let by_type = dead.iter().find(|d| d.key == "nul-type").unwrap();
    assert_eq!(by_type.reason, "malformed");
    assert_eq!(by_type.message_type, "usage\\0recorded");
    assert_eq!(
        by_type
            .headers
            .get("inbox-raw-message-type")
            .map(String::as_str),
        Some("usage\0recorded")
    );
    let by_tenant = dead.iter().find(|d| d.key == "nul-tenant").unwrap();
    assert_eq!(by_tenant.tenant.as_deref(), Some("acme\\0"));
    assert_eq!(
        by_tenant
            .headers
            .get("inbox-raw-tenant")
            .map(String::as_str),
        Some("acme\0")
    );
    // Again (a redelivery): decided at once, never a batch error, and dead-lettered
    // once.
    assert_eq!(
        store.process_batch(&g, &batch[1..2]).unwrap(),
        [Decision::AlreadyDeadLettered]
    );
    assert_eq!(store.dead_letters(&g).unwrap().len(), 2);
    // The key itself cannot hold one.
    assert!(MessageKey::new("k\0").is_err());
    // A transport's own dead letter of such a delivery is escaped the same way.
    let outcome = store
        .dead_letter(
            &g,
            &with_type(usage("nul-from-broker", 1), "x\0y"),
            DeadLetterReason::Malformed,
            "unreadable delivery",
        )
        .unwrap();
    assert_eq!(outcome, inbox_core::DeadLetterOutcome::Recorded);
    let dead = store.dead_letters(&g).unwrap();
    assert!(dead
        .iter()
        .any(|d| d.key == "nul-from-broker" && d.message_type == "x\\0y"));
    let again = store
        .dead_letter(
            &g,
            &with_type(usage("nul-from-broker", 1), "x\0y"),
            DeadLetterReason::Malformed,
            "unreadable delivery",
        )
        .unwrap();
    assert_eq!(again, inbox_core::DeadLetterOutcome::AlreadyDead);
}

/// A delivery whose data one of the store's own statements rejects (here a message
/// type longer than a narrowed column) used to fail its whole batch forever: the batch
/// is split until the delivery is alone, and it is dead-lettered as `malformed`.
fn a_data_error_on_the_stores_statements_splits_the_batch<F: Fixture>(fx: &F) {
    let store = fx.builder().build().unwrap();
    if store.backend() == Backend::Sqlite {
        // SQLite does not enforce declared lengths: nothing to reject.
        return;
    }
    drop(store);
    fx.execute("ALTER TABLE inbox_claims ALTER COLUMN message_type TYPE varchar(20)");
    let long_type = "usage.recorded.with.a.very.long.type";
    let store = fx
        .builder()
        .handler(Recorder::new(GROUP))
        .handler({
            let mut long = Recorder::new(GROUP);
            long = long.behaviour(|_, _| Outcome::Apply);
            LongType(long, long_type)
        })
        .build()
        .unwrap();
    fx.connect().create_effects().unwrap();
    let g = group(GROUP);
    let batch: Vec<Envelope> = (0..8)
        .map(|i| {
            let env = usage(&format!("m{i}"), 1);
            if i == 5 {
                with_type(env, long_type)
            } else {
                env
            }
        })
        .collect();
    let decisions = store.process_batch(&g, &batch).unwrap();
    for (i, decision) in decisions.iter().enumerate() {
        if i == 5 {
            assert_eq!(
                decision,
                &Decision::DeadLettered(DeadLetterReason::Malformed)
            );
        } else {
            assert_eq!(decision, &Decision::Processed, "m{i}");
        }
    }
    assert_eq!(fx.connect().effect_count().unwrap(), 7);
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].last_error.as_deref().unwrap().contains("too long"));
}

/// A recorder under another message type.
struct LongType(Recorder, &'static str);

impl<C: TestConn + Send + 'static> inbox_core::Handler<C> for LongType {
    type Message = inbox_test_support::Usage;
    fn group(&self) -> &inbox_core::ConsumerGroup {
        inbox_core::Handler::<C>::group(&self.0)
    }
    fn message_type(&self) -> &str {
        self.1
    }
    fn handle(
        &self,
        conn: &mut C,
        msg: Self::Message,
        ctx: &inbox_core::MessageContext<'_>,
    ) -> Result<(), inbox_core::HandlerError> {
        inbox_core::Handler::<C>::handle(&self.0, conn, msg, ctx)
    }
}

/// A message whose handler always raises a serialization failure used to rerun its
/// batch for free, forever. The free reruns stay; once alone and spent, the error
/// counts as an attempt, climbs the retry ladder and dead-letters like any failure.
fn contention_inside_a_handler_counts_once_the_free_reruns_are_spent<F: Fixture>(fx: &F) {
    let clock = ManualClock::new(start_time());
    let handler = Recorder::new(GROUP)
        .policy(RetryPolicy::new(3, Duration::from_secs(1), Duration::from_secs(60)).unwrap())
        .behaviour(|key, _| {
            if key == "hot" {
                Outcome::DbError(
                    DatabaseErrorKind::SerializationFailure,
                    "could not serialize access",
                )
            } else {
                Outcome::Apply
            }
        });
    let store = fx.open(fx.builder().clock(Arc::new(clock.clone())).handler(handler));
    let g = group(GROUP);
    let decisions = store
        .process_batch(&g, &[usage("a", 1), usage("hot", 1), usage("b", 1)])
        .unwrap();
    assert_eq!(decisions[0], Decision::Processed);
    assert_eq!(decisions[1], Decision::RetryAfter(Duration::from_secs(1)));
    assert_eq!(decisions[2], Decision::Processed);
    let claim = store.claim(&key("hot")).unwrap().expect("claim");
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Failed, 1));
    for _ in 0..2 {
        clock.advance(Duration::from_secs(120));
        store.process_batch(&g, &[usage("hot", 1)]).unwrap();
    }
    let claim = store.claim(&key("hot")).unwrap().expect("claim");
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Dead, 3));
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, "max_attempts");
}

/// `retry_after(Duration::MAX)` overflowed `now + delay` and panicked out of
/// `process_batch`; it saturates at `MAX_RETRY_DELAY`.
fn a_huge_retry_delay_saturates_instead_of_panicking<F: Fixture>(fx: &F) {
    let clock = ManualClock::new(start_time());
    let store = fx.open(
        fx.builder()
            .clock(Arc::new(clock.clone()))
            .handler(Recorder::new(GROUP).behaviour(|_, _| Outcome::RetryAfter(Duration::MAX))),
    );
    let g = group(GROUP);
    assert_eq!(
        store.process_batch(&g, &[usage("k", 1)]).unwrap(),
        [Decision::RetryAfter(MAX_RETRY_DELAY)]
    );
    let claim = store.claim(&key("k")).unwrap().expect("claim");
    let expected = start_time() + TimeDelta::from_std(MAX_RETRY_DELAY).unwrap();
    assert_eq!(claim.next_attempt_at, Some(expected));
}

/// A data error the database raised inside a handler (a value out of range, a
/// constraint) does not heal by retrying: dead-lettered at once as `permanent`.
fn data_errors_raised_by_a_handler_are_permanent<F: Fixture>(fx: &F) {
    let store = fx.open(
        fx.builder()
            .handler(Recorder::new(GROUP).behaviour(|key, _| match key {
                "check" => Outcome::DbError(DatabaseErrorKind::CheckViolation, "violates check"),
                "unique" => Outcome::DbError(DatabaseErrorKind::UniqueViolation, "duplicate key"),
                _ => Outcome::Apply,
            })),
    );
    let g = group(GROUP);
    let decisions = store
        .process_batch(&g, &[usage("check", 1), usage("ok", 1), usage("unique", 1)])
        .unwrap();
    let permanent = Decision::DeadLettered(DeadLetterReason::Permanent);
    assert_eq!(
        decisions,
        [permanent.clone(), Decision::Processed, permanent]
    );
}

/// A real class-22 error from a handler's own statement on PostgreSQL.
#[test]
fn a_division_by_zero_in_a_handler_is_dead_lettered_at_once() {
    let Some(fx) = PgFixture::new() else { return };
    let store = fx
        .builder()
        .handler(Recorder::new(GROUP).behaviour(|_, _| Outcome::Sql("SELECT 1/0")))
        .build()
        .unwrap();
    let g = group(GROUP);
    assert_eq!(
        store.process_batch(&g, &[usage("k", 1)]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::Permanent)]
    );
}

/// A redelivered message commits its start mark; a store error after it (here a lock
/// wait that times out) is not a crash: three such errors used to dead-letter an
/// innocent message as `crash_loop` without its handler ever running.
#[test]
fn store_errors_after_a_start_mark_are_not_crashes() {
    let Some(fx) = PgFixture::new() else { return };
    drop(fx.builder().build().unwrap());
    let lock = ProjectionLock::named(&inbox_test_support::unique_name("usage-totals"));
    let handler = Recorder::new(GROUP).lock(lock);
    let calls = handler.calls();
    let url = format!("{}?options=-c%20lock_timeout%3D100", fx.url());
    let store = Store::<diesel::PgConnection>::builder(url)
        .schema(fx.schema.clone())
        .handler(handler)
        .build()
        .unwrap();
    fx.connect().create_effects().unwrap();
    let g = group(GROUP);
    let env = usage("k", 1).redelivered();
    {
        // Another session holds the projection lock exclusively (a rebuild, say).
        use diesel::connection::SimpleConnection;
        let mut holder = fx.connect();
        holder
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock({})",
                lock.id()
            ))
            .unwrap();
        for _ in 0..5 {
            assert!(store.process_batch(&g, std::slice::from_ref(&env)).is_err());
        }
        holder.batch_execute("ROLLBACK").unwrap();
    }
    assert_eq!(
        store.process_batch(&g, &[env]).unwrap(),
        [Decision::Processed]
    );
    assert_eq!(calls.lock().unwrap().len(), 1);
    assert_eq!(fx.connect().effects_of("k").unwrap(), 1);
}

/// Lock before claim: a live batch waits behind a projection lock held exclusively
/// (a rebuild) *before* it claims, so the rebuild's own claims never wait on it. The
/// holder inserts the batch's claim while the batch waits: that insert would block
/// behind the batch's uncommitted claim if the batch had claimed first.
#[test]
fn a_live_batch_waits_behind_an_exclusive_projection_lock_before_it_claims() {
    use diesel::connection::SimpleConnection;
    let Some(fx) = PgFixture::new() else { return };
    let lock = ProjectionLock::named(&inbox_test_support::unique_name("usage-totals"));
    let handler = Recorder::new(GROUP).lock(lock);
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));
    let mut holder = fx.connect();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({}); SET LOCAL lock_timeout = '500ms'",
            lock.id()
        ))
        .unwrap();
    let outcome = Arc::new(Mutex::new(None));
    let worker = {
        let (store, outcome) = (store.clone(), Arc::clone(&outcome));
        std::thread::spawn(move || {
            let decisions = store.process_batch(&group(GROUP), &[usage("k", 1)]);
            *outcome.lock().unwrap() = Some(decisions);
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        calls.lock().unwrap().is_empty(),
        "the handler ran under the lock"
    );
    let insert = holder.batch_execute(
        "INSERT INTO inbox_claims (consumer_group, message_key, message_type, payload_digest, \
         status, first_seen_at, updated_at) VALUES ('billing.daily-usage', 'k', 'usage.recorded', \
         '\\x00', 'done', now(), now()) ON CONFLICT DO NOTHING",
    );
    assert!(
        insert.is_ok(),
        "the live batch claimed before taking the lock: {insert:?}"
    );
    holder.batch_execute("ROLLBACK").unwrap();
    worker.join().unwrap();
    assert_eq!(
        outcome.lock().unwrap().take().unwrap().unwrap(),
        [Decision::Processed]
    );
}

/// A store whose batches may hold their transaction for `deadline`.
fn bounded_store(
    fx: &PgFixture,
    deadline: Duration,
    handler: Recorder,
) -> Store<diesel::PgConnection> {
    fx.builder()
        .batch_deadline(deadline)
        .statement_timeout(deadline / 2)
        .handler(handler)
        .build()
        .unwrap()
}

/// A handler that hangs held the batch transaction and the projection lock forever.
/// Past the batch deadline the server ends the idle transaction: the lock is free for
/// a rebuild while the handler still hangs, nothing of the batch commits, and the
/// store's next batch runs on a fresh connection.
#[test]
fn a_hung_handler_releases_its_locks_at_the_batch_deadline() {
    use diesel::connection::SimpleConnection;
    let Some(fx) = PgFixture::new() else { return };
    let lock = ProjectionLock::named(&inbox_test_support::unique_name("usage-totals"));
    let handler = Recorder::new(GROUP).lock(lock).behaviour(|key, _| {
        if key == "hang" {
            Outcome::Sleep(Duration::from_secs(4))
        } else {
            Outcome::Apply
        }
    });
    let calls = handler.calls();
    let store = bounded_store(&fx, Duration::from_millis(300), handler);
    fx.connect().create_effects().unwrap();
    let worker = {
        let store = store.clone();
        std::thread::spawn(move || store.process_batch(&group(GROUP), &[usage("hang", 1)]))
    };
    while calls.lock().unwrap().is_empty() {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Without the deadline this waits for the hung handler's lock and times out.
    let mut rebuild = fx.connect();
    let taken = rebuild.batch_execute(&format!(
        "BEGIN; SET LOCAL lock_timeout = '2s'; SELECT pg_advisory_xact_lock({}); COMMIT",
        lock.id()
    ));
    assert!(
        taken.is_ok(),
        "the hung batch still holds its lock: {taken:?}"
    );
    let outcome = worker.join().unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
    assert_eq!(fx.connect().effect_count().unwrap(), 0);
    assert!(store.claim(&key("hang")).unwrap().is_none());
    assert_eq!(
        store
            .process_batch(&group(GROUP), &[usage("next", 1)])
            .unwrap(),
        [Decision::Processed]
    );
}

/// A statement that runs past the statement timeout is cancelled: a failure of the
/// message whose handler ran it, counted as an attempt.
#[test]
fn a_statement_past_the_timeout_is_a_failure_of_its_message() {
    let Some(fx) = PgFixture::new() else { return };
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "slow" {
            Outcome::Sql("SELECT pg_sleep(3)")
        } else {
            Outcome::Apply
        }
    });
    let store = bounded_store(&fx, Duration::from_millis(400), handler);
    fx.connect().create_effects().unwrap();
    let decisions = store
        .process_batch(&group(GROUP), &[usage("slow", 1), usage("ok", 1)])
        .unwrap();
    assert!(
        matches!(decisions[0], Decision::RetryAfter(_)),
        "{decisions:?}"
    );
    assert_eq!(decisions[1], Decision::Processed);
    let claim = store.claim(&key("slow")).unwrap().expect("claim");
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Failed, 1));
}

/// A redelivered message whose handler hangs past the deadline is counted like a
/// crash: after the crash limit it is dead-lettered as `crash_loop` without running.
#[test]
fn a_redelivery_that_hangs_is_counted_like_a_crash() {
    let Some(fx) = PgFixture::new() else { return };
    let handler = Recorder::new(GROUP).behaviour(|_, _| Outcome::Sleep(Duration::from_millis(700)));
    let calls = handler.calls();
    let store = fx.open(
        fx.builder()
            .batch_deadline(Duration::from_millis(300))
            .statement_timeout(Duration::from_millis(150))
            .crash_limit(2)
            .handler(handler),
    );
    let env = usage("hang", 1).redelivered();
    let g = group(GROUP);
    for _ in 0..2 {
        assert!(store.process_batch(&g, std::slice::from_ref(&env)).is_err());
    }
    assert_eq!(
        store.process_batch(&g, &[env]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::CrashLoop)]
    );
    assert_eq!(calls.lock().unwrap().len(), 2);
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("crash loop: 2 starts without an outcome (limit 2)")
    );
}

#[test]
fn batch_deadline_and_statement_timeout_are_checked_when_built() {
    let fx = inbox_test_support::SqliteFixture::new();
    for (deadline, statement) in [
        (Duration::ZERO, Duration::ZERO),
        (Duration::from_secs(1), Duration::from_secs(2)),
    ] {
        let built = fx
            .builder()
            .batch_deadline(deadline)
            .statement_timeout(statement)
            .build();
        assert!(
            matches!(built, Err(inbox_diesel::Error::Config(_))),
            "{deadline:?}/{statement:?}: {built:?}"
        );
    }
}

/// `last_error` keeps at most 4,000 bytes of a failure, cut where a character ends.
fn a_long_error_is_cut_on_a_char_boundary<F: Fixture>(fx: &F) {
    // 4,001 bytes of two-byte characters after one byte: byte 4,000 falls inside one.
    let long = format!("x{}", "é".repeat(3000));
    let exact = "y".repeat(4000);
    let message = move |key: &str| match key {
        "long" => long.clone(),
        _ => exact.clone(),
    };
    let store = fx
        .open(fx.builder().handler(
            Recorder::new(GROUP).behaviour(move |key, _| Outcome::FailWith(message(key))),
        ));
    let g = group(GROUP);
    store
        .process_batch(&g, &[usage("long", 1), usage("exact", 1)])
        .unwrap();
    let long = store
        .claim(&key("long"))
        .unwrap()
        .unwrap()
        .last_error
        .unwrap();
    assert_eq!(long.len(), 3999, "cut back to the character boundary");
    assert!(format!("x{}", "é".repeat(3000)).starts_with(&long));
    let exact = store
        .claim(&key("exact"))
        .unwrap()
        .unwrap()
        .last_error
        .unwrap();
    assert_eq!(exact, "y".repeat(4000), "exactly the limit is kept whole");
}

/// A dead letter keeps the delivery's headers, as delivered.
fn dead_letters_keep_the_delivery_headers<F: Fixture>(fx: &F) {
    let store = fx.open(
        fx.builder()
            .handler(Recorder::new(GROUP).behaviour(|_, _| Outcome::Permanent)),
    );
    let g = group(GROUP);
    let mut env = usage("k", 1);
    env.headers
        .insert("traceparent".to_owned(), "00-abc-def-01".to_owned());
    env.headers.insert("x-note".to_owned(), "kept".to_owned());
    store.process_batch(&g, &[env.clone()]).unwrap();
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].headers, env.headers);
}

/// A batch of several message types: each delivery reaches the handler of its own type
/// (or none), whatever the order.
fn each_message_type_in_a_batch_reaches_its_own_handler<F: Fixture>(fx: &F) {
    let store = fx.open(fx.builder().handler(Recorder::new(GROUP)).handler(LongType(
        Recorder::new(GROUP).behaviour(|_, _| Outcome::Permanent),
        "usage.corrected",
    )));
    let g = group(GROUP);
    let batch = [
        usage("a", 1),
        with_type(usage("b", 1), "usage.corrected"),
        with_type(usage("c", 1), "usage.unknown"),
        usage("d", 1),
        with_type(usage("e", 1), "usage.corrected"),
    ];
    assert_eq!(
        store.process_batch(&g, &batch).unwrap(),
        [
            Decision::Processed,
            Decision::DeadLettered(DeadLetterReason::Permanent),
            Decision::DeadLettered(DeadLetterReason::NoHandler),
            Decision::Processed,
            Decision::DeadLettered(DeadLetterReason::Permanent),
        ]
    );
}

/// The broker gave up on a message whose key a done claim of another payload holds (an
/// impostor): its dead letter is recorded, counted, and the claim is left alone.
fn a_broker_dead_letter_of_another_payload_is_recorded_and_the_claim_untouched<F: Fixture>(fx: &F) {
    let store = fx.open(fx.builder().handler(Recorder::new(GROUP)));
    let g = group(GROUP);
    store.process_batch(&g, &[usage("k", 1)]).unwrap();
    let (outcome, counted) = inbox_test_support::metrics::capture(|| {
        store
            .dead_letter(&g, &usage("k", 2), DeadLetterReason::DeliveryLimit, "limit")
            .unwrap()
    });
    assert_eq!(outcome, inbox_core::DeadLetterOutcome::Recorded);
    assert_eq!(
        counted.counter(
            "inbox_dead_lettered_total",
            &[("group", GROUP), ("reason", "delivery_limit")]
        ),
        1
    );
    let claim = store.claim(&key("k")).unwrap().unwrap();
    assert_eq!(claim.status, ClaimStatus::Done);
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, "delivery_limit");
    // Its own payload's dead letter is not counted again.
    let (_, again) = inbox_test_support::metrics::capture(|| {
        store
            .dead_letter(&g, &usage("k", 1), DeadLetterReason::DeliveryLimit, "limit")
            .unwrap()
    });
    assert_eq!(
        again.counter(
            "inbox_dead_lettered_total",
            &[("group", GROUP), ("reason", "delivery_limit")]
        ),
        0
    );
}

/// A handler first called in the isolated run (a batch-mate failed the optimistic one)
/// that restarts the transaction and then errs: its savepoint cannot be rolled back,
/// which only happens when the transaction is no longer the store's: the group stops.
#[test]
fn a_restart_inside_the_isolated_run_stops_the_group() {
    // Swallowed (the handler returns Ok) and propagated (it returns the error).
    let cases = [
        ("ROLLBACK; BEGIN; SELECT 1/0", false),
        ("COMMIT", false),
        ("ROLLBACK", false),
        ("COMMIT; SELECT 1/0", true),
        ("ROLLBACK; SELECT 1/0", true),
    ];
    for (sql, propagate) in cases {
        let Some(fx) = PgFixture::new() else { return };
        let handler = Recorder::new(GROUP).behaviour(move |key, _| match key {
            "a-fails" => Outcome::ApplyThenFail,
            _ if propagate => Outcome::Sql(sql),
            _ => Outcome::IgnoreSql(sql),
        });
        let store = fx.open(fx.builder().handler(handler));
        let decisions = store
            .process_batch(&group(GROUP), &[usage("a-fails", 1), usage("b-rogue", 1)])
            .unwrap();
        assert!(all_stop(&decisions), "{sql}: {decisions:?}");
    }
}

/// A connection lost inside the isolated run (here the handler ends its own backend)
/// is the store's infrastructure failing: nothing is decided, nothing acked, and the
/// group does not halt over it.
#[test]
fn a_connection_lost_inside_the_isolated_run_is_a_store_error_not_a_stop() {
    let Some(fx) = PgFixture::new() else { return };
    let handler = Recorder::new(GROUP).behaviour(|key, _| match key {
        "a-fails" => Outcome::ApplyThenFail,
        _ => Outcome::Sql("SELECT pg_terminate_backend(pg_backend_pid())"),
    });
    let store = fx.open(fx.builder().handler(handler));
    let outcome = store.process_batch(&group(GROUP), &[usage("a-fails", 1), usage("b-dies", 1)]);
    assert!(outcome.is_err(), "{outcome:?}");
}
