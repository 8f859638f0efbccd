//! The operator API on both backends: failure groups, replay to one group alone and
//! exactly once (twice, and twice at once), replayable reasons, discard, redrive,
//! stats, and the schema check of the operator migration.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use inbox_core::{
    relay_in_process, ClaimInvariantViolated, Clock, DeadLetterReason, Decision, Envelope,
    GroupHalts, InProcessTransport, ManualClock, MessageKey, RetryPolicy, REPLAY_GROUP_HEADER,
};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{
    BulkReport, DeadLetterFilter, DiscardOutcome, LetterStatus, RedriveFilter, ReplayOutcome,
    ReplayTarget,
};
use inbox_diesel::{ClaimStatus, Error, Store};
use inbox_test_support::{group, on_both_backends, usage, Fixture, Outcome, Recorder, TestConn};

const FAILING: &str = "billing.daily-usage";
const BYSTANDER: &str = "billing.audit";

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(
        Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap(),
    ))
}

fn policy() -> RetryPolicy {
    RetryPolicy::new(2, Duration::from_secs(1), Duration::from_secs(1)).unwrap()
}

struct Scene<C: inbox_test_support::FullConnection> {
    store: Store<C>,
    clock: Arc<ManualClock>,
    healed: Arc<AtomicBool>,
    failing_calls: Arc<std::sync::Mutex<Vec<String>>>,
    bystander_calls: Arc<std::sync::Mutex<Vec<String>>>,
}

/// Two groups take `usage.recorded`; the first fails every `bad-*` key until healed.
fn scene<F: Fixture>(fx: &F) -> Scene<F::Conn> {
    let clock = clock();
    let healed = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&healed);
    let failing = Recorder::new(FAILING)
        .policy(policy())
        .behaviour(move |key, _| {
            if key.starts_with("bad-") && !flag.load(Ordering::SeqCst) {
                Outcome::FailWith(format!("ledger row {} is locked", key.len() * 7))
            } else {
                Outcome::Apply
            }
        });
    let failing_calls = failing.calls();
    let bystander = Recorder::new(BYSTANDER);
    let bystander_calls = bystander.calls();
    let store = fx
        .builder()
        .clock(clock.clone())
        .handler(failing)
        .handler(bystander)
        .build()
        .expect("store");
    store.connection().unwrap().create_effects().unwrap();
    Scene {
        store,
        clock,
        healed,
        failing_calls,
        bystander_calls,
    }
}

fn transport<C: inbox_test_support::FullConnection>(s: &Scene<C>) -> InProcessTransport<Store<C>> {
    InProcessTransport::new(s.store.clone()).with_clock(s.clock.clone())
}

fn relay<C: inbox_test_support::FullConnection>(
    s: &Scene<C>,
    t: &mut InProcessTransport<Store<C>>,
) -> usize {
    let n = relay_in_process(&s.store, t, "relay-1", 100).expect("relay");
    t.run_until_idle().expect("run");
    n
}

fn calls(c: &Arc<std::sync::Mutex<Vec<String>>>, key: &str) -> usize {
    c.lock().unwrap().iter().filter(|k| *k == key).count()
}

const BAD: [&str; 3] = ["bad-1", "bad-22", "bad-333"];

/// Dead-letters the three bad keys in the failing group (the bystander applies them).
fn dead_letter_three<C: inbox_test_support::FullConnection + TestConn>(
    s: &Scene<C>,
) -> InProcessTransport<Store<C>> {
    let mut t = transport(s);
    for key in BAD.iter().chain(["good-1"].iter()) {
        t.publish(usage(key, 5)).unwrap();
    }
    t.run_until_idle().unwrap();
    t
}

fn replays_reach_the_failing_group_alone_and_apply_once<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let mut t = dead_letter_three(&s);
    let pending = DeadLetterFilter::default().status(LetterStatus::Pending);
    let groups = Operator::new(&s.store).failure_groups(&pending).unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    let fg = &groups[0];
    assert_eq!(fg.count, 3);
    assert_eq!(fg.reason, DeadLetterReason::MaxAttempts);
    assert_eq!(fg.signature, "ledger row <n> is locked");
    assert_eq!(fg.consumer_groups, [FAILING]);
    assert!(fg.replayable);

    s.healed.store(true, Ordering::SeqCst);
    let by_group = pending.clone().failure_group(fg.fingerprint.clone());
    let report = Operator::new(&s.store)
        .replay_dead_letters(&by_group, None, &ReplayTarget::default())
        .unwrap();
    assert_eq!(report.matched, 3);
    assert_eq!(report.affected, 3, "{report:?}");
    let before = t.stats();
    assert_eq!(relay(&s, &mut t), 3);
    // Delivered to the failing group alone: no copy reached the bystander (whose
    // claim would absorb it, unless retention had purged it).
    let after = t.stats();
    assert_eq!(after.delivered - before.delivered, 3);
    assert_eq!(after.duplicates, before.duplicates);
    let mut conn = s.store.connection().unwrap();
    for key in BAD {
        // Once by the bystander at first, once by the healed group after the replay.
        assert_eq!(conn.effects_of(key).unwrap(), 2, "{key}");
        assert_eq!(
            calls(&s.bystander_calls, key),
            1,
            "{key}: the replay reached the bystander"
        );
        let claim = s
            .store
            .claim_record(&inbox_core::ClaimKey::new(
                group(FAILING),
                MessageKey::new(key).unwrap(),
            ))
            .unwrap()
            .unwrap();
        assert_eq!(claim.status, ClaimStatus::Done);
    }
    // The same replay again: the claims are done, nothing is enqueued or applied.
    let again = Operator::new(&s.store)
        .replay_dead_letters(
            &by_group.clone().status(LetterStatus::Replayed),
            None,
            &ReplayTarget::default(),
        )
        .unwrap();
    assert_eq!(again.affected, 0, "{again:?}");
    assert_eq!(again.skipped, 3, "{again:?}");
    assert_eq!(relay(&s, &mut t), 0);
    assert_eq!(conn.effects_of("bad-1").unwrap(), 2);
    let pending_again = Operator::new(&s.store)
        .replay_dead_letters(&by_group, None, &ReplayTarget::default())
        .unwrap();
    assert_eq!(pending_again, BulkReport::default());

    let letters = Operator::new(&s.store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 10)
        .unwrap();
    assert_eq!(letters.len(), 3);
    for letter in &letters {
        assert_eq!(letter.status, LetterStatus::Replayed);
        assert_eq!(letter.replay_count, 1);
        assert!(letter.replayed_at.is_some());
    }
}

fn one_letter_replayed_twice_and_twice_at_once_is_enqueued_once<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let mut t = dead_letter_three(&s);
    s.healed.store(true, Ordering::SeqCst);
    let letters = Operator::new(&s.store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 10)
        .unwrap();
    let (first, rest) = letters.split_first().unwrap();
    let target = ReplayTarget::default();
    assert!(matches!(
        Operator::new(&s.store)
            .replay_dead_letter(first.id, &target)
            .unwrap(),
        ReplayOutcome::Replayed { sequence: 1, .. }
    ));
    // Before the relay ran: the claim is a due failed one now, not dead.
    assert_eq!(
        Operator::new(&s.store)
            .replay_dead_letter(first.id, &target)
            .unwrap(),
        ReplayOutcome::ClaimNotDead {
            status: Some(ClaimStatus::Failed)
        }
    );
    // Two at once, per remaining letter: one wins.
    for letter in rest {
        let outcomes: Vec<ReplayOutcome> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        Operator::new(&s.store)
                            .replay_dead_letter(letter.id, &target)
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let won = outcomes
            .iter()
            .filter(|o| matches!(o, ReplayOutcome::Replayed { .. }))
            .count();
        assert_eq!(won, 1, "{outcomes:?}");
    }
    assert_eq!(relay(&s, &mut t), 3);
    let mut conn = s.store.connection().unwrap();
    for key in BAD {
        assert_eq!(conn.effects_of(key).unwrap(), 2, "{key}");
        assert_eq!(
            calls(&s.failing_calls, key),
            3,
            "{key}: two failures and one replay"
        );
    }
}

fn a_message_failing_again_after_a_replay_is_dead_again_with_its_replay_visible<F: Fixture>(
    fx: &F,
) {
    let s = scene(fx);
    let mut t = dead_letter_three(&s);
    let filter = DeadLetterFilter::default().message_key("bad-1");
    let first = Operator::new(&s.store)
        .list_dead_letters(&filter, 0, 1)
        .unwrap()
        .remove(0);
    assert!(matches!(
        Operator::new(&s.store)
            .replay_dead_letter(first.id, &ReplayTarget::default())
            .unwrap(),
        ReplayOutcome::Replayed { sequence: 1, .. }
    ));
    relay(&s, &mut t); // still failing: dead again
    let letters = Operator::new(&s.store)
        .list_dead_letters(&filter, 0, 10)
        .unwrap();
    assert_eq!(letters.len(), 2, "{letters:?}");
    let (newest, oldest) = (&letters[0], &letters[1]);
    assert_eq!(newest.delivered_by_replay, Some(1));
    assert_eq!(newest.status, LetterStatus::Pending);
    assert_eq!(oldest.replay_count, 1);
    let details = Operator::new(&s.store)
        .dead_letter_details(newest.id)
        .unwrap()
        .unwrap();
    assert_eq!(details.headers[REPLAY_GROUP_HEADER], FAILING);
    assert_eq!(details.claim_status, Some(ClaimStatus::Dead));
    assert_eq!(details.first_failure_at, oldest.dead_lettered_at);
    assert_eq!(details.last_failure_at, newest.dead_lettered_at);
    assert_eq!(details.payload, usage("bad-1", 5).payload);
    // Replayed again and healed: sequence 2, applied once by this group.
    s.healed.store(true, Ordering::SeqCst);
    assert!(matches!(
        Operator::new(&s.store)
            .replay_dead_letter(newest.id, &ReplayTarget::default())
            .unwrap(),
        ReplayOutcome::Replayed { sequence: 2, .. }
    ));
    relay(&s, &mut t);
    assert_eq!(
        s.store.connection().unwrap().effects_of("bad-1").unwrap(),
        2
    );
}

fn reasons_that_cannot_be_replayed_are_refused_and_no_handler_is_replayed_once_handled<
    F: Fixture,
>(
    fx: &F,
) {
    let s = scene(fx);
    let g = group(FAILING);
    // A key collision: another payload under a claimed key.
    assert_eq!(
        s.store.process_batch(&g, &[usage("k-1", 1)]).unwrap(),
        [Decision::Processed]
    );
    assert_eq!(
        s.store.process_batch(&g, &[usage("k-1", 2)]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::KeyCollision)]
    );
    // A payload that does not decode.
    let bad_json = Envelope::new(
        MessageKey::new("k-2").unwrap(),
        "usage.recorded",
        b"{".to_vec(),
    );
    assert_eq!(
        s.store.process_batch(&g, &[bad_json]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::DecodeError)]
    );
    // A group this store has no handler for.
    let late = group("billing.late");
    assert_eq!(
        s.store.process_batch(&late, &[usage("k-3", 3)]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::NoHandler)]
    );
    let target = ReplayTarget::default();
    for reason in [
        DeadLetterReason::KeyCollision,
        DeadLetterReason::DecodeError,
    ] {
        let letter = Operator::new(&s.store)
            .list_dead_letters(&DeadLetterFilter::default().reason(reason), 0, 1)
            .unwrap()
            .remove(0);
        match Operator::new(&s.store)
            .replay_dead_letter(letter.id, &target)
            .unwrap()
        {
            ReplayOutcome::Refused { reason: r, advice } => {
                assert_eq!(r, reason);
                assert!(advice.contains("discard"), "{advice}");
            }
            other => panic!("{reason}: {other:?}"),
        }
        let details = Operator::new(&s.store)
            .dead_letter_details(letter.id)
            .unwrap()
            .unwrap();
        assert!(details.replay_refusal.is_some());
    }
    // The collision's claim is untouched: still the first payload's, done.
    let mut conn = s.store.connection().unwrap();
    assert_eq!(conn.effects_of("k-1").unwrap(), 1);
    drop(conn);
    let report = Operator::new(&s.store)
        .replay_dead_letters(&DeadLetterFilter::default(), None, &target)
        .unwrap();
    assert_eq!(report.refused, 2, "{report:?}");
    assert_eq!(report.affected, 1, "{report:?}: the no_handler letter");

    // The handler now exists: the same database, a store that has it.
    let late_handler = Recorder::new("billing.late");
    let late_calls = late_handler.calls();
    let later = fx
        .builder()
        .clock(s.clock.clone())
        .handler(late_handler)
        .build()
        .unwrap();
    let mut t = InProcessTransport::new(later.clone()).with_clock(s.clock.clone());
    assert_eq!(relay_in_process(&later, &mut t, "relay-2", 10).unwrap(), 1);
    t.run_until_idle().unwrap();
    assert_eq!(late_calls.lock().unwrap().as_slice(), ["k-3"]);
    assert_eq!(later.connection().unwrap().effects_of("k-3").unwrap(), 1);
}

fn discard_bulk_limits_and_stats<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let _t = dead_letter_three(&s);
    let stats = Operator::new(&s.store).operator_stats().unwrap();
    let failing = stats
        .groups
        .iter()
        .find(|g| g.consumer_group == FAILING)
        .unwrap();
    assert_eq!((failing.done, failing.dead, failing.failed), (1, 3, 0));
    assert_eq!(stats.dead_letters.len(), 1);
    assert_eq!(stats.dead_letters[0].count, 3);
    assert_eq!(stats.outbox_backlog, 0);

    let report = Operator::new(&s.store)
        .discard_dead_letters(&DeadLetterFilter::default(), Some(2))
        .unwrap();
    assert_eq!((report.matched, report.affected), (2, 2));
    let left = Operator::new(&s.store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 10)
        .unwrap();
    assert_eq!(left.len(), 1);
    let discarded = Operator::new(&s.store)
        .list_dead_letters(
            &DeadLetterFilter::default().status(LetterStatus::Discarded),
            0,
            10,
        )
        .unwrap();
    assert_eq!(discarded.len(), 2);
    assert_eq!(
        Operator::new(&s.store)
            .discard_dead_letter(discarded[0].id)
            .unwrap(),
        DiscardOutcome::AlreadyDiscarded
    );
    assert_eq!(
        Operator::new(&s.store)
            .replay_dead_letter(discarded[0].id, &ReplayTarget::default())
            .unwrap(),
        ReplayOutcome::Discarded
    );
    assert_eq!(
        Operator::new(&s.store)
            .discard_dead_letter(i64::MAX)
            .unwrap(),
        DiscardOutcome::NotFound
    );
    // Paging, newest first.
    let page: Vec<i64> = Operator::new(&s.store)
        .list_dead_letters(
            &DeadLetterFilter::default().status(LetterStatus::Discarded),
            1,
            1,
        )
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(page, [discarded[1].id]);
    // Purge of discarded letters, after their window.
    s.clock.advance(Duration::from_secs(3600));
    assert_eq!(
        Operator::new(&s.store)
            .purge_discarded_dead_letters(Duration::from_secs(60), 1)
            .unwrap(),
        2
    );
}

fn a_failed_claim_whose_retry_copy_was_lost_is_redriven_once<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let g = group(FAILING);
    // One failure: a failed claim with its payload, due in a second; its retry copy
    // is lost (never handed to any transport).
    assert!(matches!(
        s.store.process_batch(&g, &[usage("bad-9", 4)]).unwrap()[..],
        [Decision::RetryAfter(_)]
    ));
    let redrive = RedriveFilter::default().overdue_for(Duration::from_secs(60));
    let target = ReplayTarget::default();
    assert_eq!(
        Operator::new(&s.store)
            .redrive_failed_claims(&redrive, None, &target)
            .unwrap()
            .matched,
        0,
        "not overdue yet"
    );
    s.clock.advance(Duration::from_secs(120));
    let stats = Operator::new(&s.store).operator_stats().unwrap();
    let failing = stats
        .groups
        .iter()
        .find(|g| g.consumer_group == FAILING)
        .unwrap();
    assert_eq!((failing.failed, failing.retries_due), (1, 1));
    assert!(failing.oldest_pending_retry.is_some());
    s.healed.store(true, Ordering::SeqCst);
    let report = Operator::new(&s.store)
        .redrive_failed_claims(&redrive, None, &target)
        .unwrap();
    assert_eq!((report.matched, report.affected), (1, 1));
    // Just redriven: not overdue any more.
    assert_eq!(
        Operator::new(&s.store)
            .redrive_failed_claims(&redrive, None, &target)
            .unwrap()
            .matched,
        0
    );
    assert_eq!(
        Operator::new(&s.store)
            .operator_stats()
            .unwrap()
            .outbox_backlog,
        1
    );
    let mut t = transport(&s);
    assert_eq!(relay(&s, &mut t), 1);
    assert_eq!(
        s.store.connection().unwrap().effects_of("bad-9").unwrap(),
        1
    );
    assert_eq!(calls(&s.bystander_calls, "bad-9"), 0);
    let claims = Operator::new(&s.store).claims_for_key("bad-9").unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].status, ClaimStatus::Done);
}

fn a_producer_row_and_replays_of_its_key_share_the_outbox<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let key = MessageKey::new("bad-1").unwrap();
    let msg =
        inbox_core::OutboxMessage::new(key, "billing", "usage.recorded", usage("bad-1", 5).payload);
    let mut conn = s.store.connection().unwrap();
    let now = s.clock.now();
    assert!(matches!(
        inbox_diesel::enqueue(&mut conn, &msg, now).unwrap(),
        inbox_core::EnqueueOutcome::Enqueued { .. }
    ));
    assert_eq!(
        inbox_diesel::enqueue(&mut conn, &msg, now).unwrap(),
        inbox_core::EnqueueOutcome::AlreadyEnqueued
    );
    drop(conn);
    let mut t = transport(&s);
    assert_eq!(relay(&s, &mut t), 1);
    let letter = Operator::new(&s.store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 1)
        .unwrap()
        .remove(0);
    assert!(matches!(
        Operator::new(&s.store)
            .replay_dead_letter(letter.id, &ReplayTarget::with_prefix("t1."))
            .unwrap(),
        ReplayOutcome::Replayed { sequence: 1, .. }
    ));
}

fn verify_schema_refuses_an_outbox_that_cannot_hold_replays<F: Fixture>(fx: &F) {
    let s = scene(fx);
    s.store.verify_schema().unwrap();
    drop(s);
    fx.execute("CREATE UNIQUE INDEX outbox_key_alone ON outbox_messages (message_key)");
    let err = fx.builder().build().unwrap_err();
    match &err {
        Error::SchemaMismatch {
            part: inbox_diesel::SchemaPart::Operator,
            expected,
            found,
            ..
        } => {
            assert_eq!(
                expected,
                "no unique index other than on (message_key, replay_seq) or a superset of it"
            );
            assert_eq!(found, "unique (message_key) [outbox_key_alone]");
        }
        other => panic!("{other}"),
    }
    fx.execute("DROP INDEX outbox_key_alone");
    fx.builder().build().unwrap();
    fx.execute("DROP TABLE inbox_canary");
    let err = fx.builder().run_migrations(false).build().unwrap_err();
    assert!(
        matches!(&err, Error::SchemaMismatch { part: inbox_diesel::SchemaPart::Operator, expected, found, .. }
            if expected == "table inbox_canary with column run_id" && found.starts_with("no such table")),
        "{err}"
    );
    fx.execute("CREATE TABLE inbox_canary (run_id TEXT, seq INTEGER, sent_at TEXT, arrived_at TEXT, arrivals INTEGER, PRIMARY KEY (run_id, seq))");
    fx.execute("DROP TABLE inbox_group_halts");
    let err = fx.builder().run_migrations(false).build().unwrap_err();
    assert!(
        matches!(&err, Error::SchemaMismatch { part: inbox_diesel::SchemaPart::Operator, expected, found, .. }
            if expected == "table inbox_group_halts with column consumer_group" && found.starts_with("no such table")),
        "{err}"
    );
    fx.execute("CREATE TABLE inbox_group_halts (consumer_group TEXT PRIMARY KEY, message_key TEXT, detail TEXT, halted_at TEXT)");
    fx.execute("DROP TABLE inbox_replay_sequences");
    let err = fx.builder().run_migrations(false).build().unwrap_err();
    assert!(
        matches!(&err, Error::SchemaMismatch { part: inbox_diesel::SchemaPart::Operator, expected, found, .. }
            if expected == "table inbox_replay_sequences with column message_key" && found.starts_with("no such table")),
        "{err}"
    );
    fx.execute("CREATE TABLE inbox_replay_sequences (message_key TEXT PRIMARY KEY, last_seq INTEGER NOT NULL)");
    // The retention index on the column goes first (SQLite keeps a column an index uses).
    fx.execute("DROP INDEX inbox_dead_letters_discarded");
    fx.execute("ALTER TABLE inbox_dead_letters DROP COLUMN discarded_at");
    let err = fx.builder().run_migrations(false).build().unwrap_err();
    assert!(
        matches!(&err, Error::SchemaMismatch { part: inbox_diesel::SchemaPart::Operator, expected, .. } if expected == "column discarded_at"),
        "{err}"
    );
}

fn a_letter_of_another_payload_never_takes_the_claim<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let _t = dead_letter_three(&s);
    // The broker gives up on an impostor under a dead key: its letter is recorded,
    // replayable by reason (delivery_limit), but the claim belongs to the original.
    let g = group(FAILING);
    let impostor = usage("bad-1", 999);
    use inbox_core::InboxStore;
    s.store
        .dead_letter(
            &g,
            &impostor,
            DeadLetterReason::DeliveryLimit,
            "delivery limit",
        )
        .unwrap();
    let letter = Operator::new(&s.store)
        .list_dead_letters(
            &DeadLetterFilter::default().reason(DeadLetterReason::DeliveryLimit),
            0,
            1,
        )
        .unwrap()
        .remove(0);
    assert_eq!(
        Operator::new(&s.store)
            .replay_dead_letter(letter.id, &ReplayTarget::default())
            .unwrap(),
        ReplayOutcome::ClaimNotDead {
            status: Some(ClaimStatus::Dead)
        }
    );
    assert_eq!(
        Operator::new(&s.store)
            .operator_stats()
            .unwrap()
            .outbox_backlog,
        0
    );
}

/// Gauges and counters recorded on this thread, by `name{label=value,...}`.
#[derive(Default)]
struct Recorded(std::sync::Mutex<std::collections::BTreeMap<String, f64>>);

struct Cell(String, Arc<Recorded>);

impl metrics::GaugeFn for Cell {
    fn increment(&self, v: f64) {
        *self.1 .0.lock().unwrap().entry(self.0.clone()).or_default() += v;
    }
    fn decrement(&self, v: f64) {
        *self.1 .0.lock().unwrap().entry(self.0.clone()).or_default() -= v;
    }
    fn set(&self, v: f64) {
        self.1 .0.lock().unwrap().insert(self.0.clone(), v);
    }
}

impl metrics::CounterFn for Cell {
    fn increment(&self, v: u64) {
        *self.1 .0.lock().unwrap().entry(self.0.clone()).or_default() += v as f64;
    }
    fn absolute(&self, v: u64) {
        self.1 .0.lock().unwrap().insert(self.0.clone(), v as f64);
    }
}

struct Capture(Arc<Recorded>);

impl Capture {
    fn cell(&self, key: &metrics::Key) -> Arc<Cell> {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        Arc::new(Cell(
            format!("{}{{{}}}", key.name(), labels.join(",")),
            Arc::clone(&self.0),
        ))
    }
}

impl metrics::Recorder for Capture {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// The key of the newest dead letter (the one the gauges test replays).
fn letter_key<C: inbox_test_support::FullConnection>(s: &Scene<C>) -> String {
    Operator::new(&s.store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 1)
        .unwrap()
        .remove(0)
        .message_key
}

fn gauges_show_backlog_unprocessed_age_failure_groups_and_replays<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let _t = dead_letter_three(&s);
    let g = group(FAILING);
    // A failed claim, first seen now, looked at 90 s later.
    assert!(matches!(
        s.store.process_batch(&g, &[usage("bad-4444", 1)]).unwrap()[..],
        [Decision::RetryAfter(_)]
    ));
    s.clock.advance(Duration::from_secs(90));
    let recorded = Arc::new(Recorded::default());
    let capture = Capture(Arc::clone(&recorded));
    let fingerprint = Operator::new(&s.store)
        .failure_groups(&DeadLetterFilter::default())
        .unwrap()[0]
        .fingerprint
        .clone();
    metrics::with_local_recorder(&capture, || {
        let letter = Operator::new(&s.store)
            .list_dead_letters(&DeadLetterFilter::default(), 0, 1)
            .unwrap();
        Operator::new(&s.store)
            .replay_dead_letter(letter[0].id, &ReplayTarget::default())
            .unwrap();
        Operator::new(&s.store).publish_operator_gauges().unwrap();
    });
    let got = recorded.0.lock().unwrap();
    let value = |k: &str| {
        got.get(k)
            .copied()
            .unwrap_or_else(|| panic!("{k} in {got:?}"))
    };
    assert_eq!(value("inbox_replays_total{kind=replay}"), 1.0);
    assert_eq!(value("inbox_outbox_backlog{}"), 1.0);
    assert_eq!(value("inbox_outbox_dead_rows{}"), 0.0);
    // The replayed claim is unprocessed again (failed, due) until its copy arrives: the
    // oldest, first seen before the 1 s retry the transport waited and the 90 s.
    let replayed = Operator::new(&s.store)
        .claims_for_key(&letter_key(&s))
        .unwrap()
        .into_iter()
        .find(|c| c.group == FAILING)
        .unwrap();
    assert_eq!(replayed.status, ClaimStatus::Failed);
    let expected = (s.clock.now() - replayed.first_seen_at).num_seconds() as f64;
    assert_eq!(expected, 91.0);
    assert_eq!(
        value(&format!(
            "inbox_oldest_unprocessed_seconds{{group={FAILING}}}"
        )),
        expected
    );
    assert_eq!(
        value(&format!(
            "inbox_oldest_unprocessed_seconds{{group={BYSTANDER}}}"
        )),
        0.0
    );
    assert_eq!(
        value(&format!(
            "inbox_dead_letters_pending{{failure_group={fingerprint},reason=max_attempts}}"
        )),
        2.0
    );
}

/// A failure group whose last pending letter is discarded goes to 0 on the next
/// publication of the same handle, instead of keeping its last count for good.
fn a_vanished_failure_group_gauge_goes_back_to_zero<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let _t = dead_letter_three(&s);
    let operator = Operator::new(&s.store);
    let fingerprint = operator
        .failure_groups(&DeadLetterFilter::default())
        .unwrap()[0]
        .fingerprint
        .clone();
    let series =
        format!("inbox_dead_letters_pending{{failure_group={fingerprint},reason=max_attempts}}");
    let recorded = Arc::new(Recorded::default());
    let capture = Capture(Arc::clone(&recorded));
    let value = |k: &str| recorded.0.lock().unwrap().get(k).copied();
    metrics::with_local_recorder(&capture, || operator.publish_operator_gauges().unwrap());
    assert_eq!(value(&series), Some(3.0));
    let discarded = operator
        .discard_dead_letters(&DeadLetterFilter::default(), None)
        .unwrap();
    assert_eq!(discarded.affected, 3);
    // A clone shares what was published.
    let clone = operator.clone();
    metrics::with_local_recorder(&capture, || clone.publish_operator_gauges().unwrap());
    assert_eq!(
        value(&series),
        Some(0.0),
        "the vanished group's gauge is reset"
    );
}

fn violation(group_name: &str, key: &str, detail: &str) -> ClaimInvariantViolated {
    ClaimInvariantViolated {
        group: group(group_name),
        key: MessageKey::new(key).unwrap(),
        detail: detail.to_owned(),
    }
}

/// A halt is recorded once (the first cause stays), listed, shown in the stats, and
/// resumed once; a group that is not halted says so, a bad name is refused by name.
fn a_halt_is_recorded_listed_and_resumed_once<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let store = &s.store;
    assert!(Operator::new(store)
        .list_halted_groups()
        .unwrap()
        .is_empty());
    assert!(
        !Operator::new(store).resume_group(FAILING).unwrap(),
        "not halted yet"
    );
    let first = violation(FAILING, "k-1", "a phantom conflict");
    store.record_halt(&first).unwrap();
    s.clock.advance(Duration::from_secs(60));
    store
        .record_halt(&violation(FAILING, "k-2", "another one"))
        .unwrap();
    let halted = Operator::new(store).list_halted_groups().unwrap();
    assert_eq!(halted.len(), 1, "{halted:?}");
    let h = &halted[0];
    assert_eq!(
        (
            h.consumer_group.as_str(),
            h.message_key.as_str(),
            h.detail.as_str()
        ),
        (FAILING, "k-1", "a phantom conflict")
    );
    assert_eq!(
        h.halted_at,
        Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap()
    );
    assert_eq!(store.halted_groups().unwrap(), [first]);
    assert_eq!(
        Operator::new(store).operator_stats().unwrap().halted,
        halted
    );
    // Another group is not touched by either.
    assert!(!Operator::new(store).resume_group(BYSTANDER).unwrap());
    assert_eq!(Operator::new(store).list_halted_groups().unwrap(), halted);
    assert!(Operator::new(store).resume_group(FAILING).unwrap());
    assert!(
        !Operator::new(store).resume_group(FAILING).unwrap(),
        "resumed already"
    );
    assert!(Operator::new(store)
        .list_halted_groups()
        .unwrap()
        .is_empty());
    assert!(store.halted_groups().unwrap().is_empty());
    assert!(Operator::new(store)
        .operator_stats()
        .unwrap()
        .halted
        .is_empty());
    // Halted again after the resume: a new record, with the new cause.
    let again = violation(FAILING, "k-3", "once more");
    store.record_halt(&again).unwrap();
    assert_eq!(store.halted_groups().unwrap(), [again]);
    assert!(matches!(
        Operator::new(store).resume_group("Not A Group"),
        Err(Error::Core(inbox_core::Error::InvalidName(
            inbox_core::InvalidName::ConsumerGroup(_)
        )))
    ));
}

/// A reason this version does not know (a newer version stored it) is never read as
/// another one: every operator read of the letter fails and names it and the text;
/// the letters of known reasons are untouched.
fn a_stored_reason_this_version_does_not_know_fails_loudly<F: Fixture>(fx: &F) {
    let s = scene(fx);
    dead_letter_three(&s);
    let op = Operator::new(&s.store);
    let listed = op
        .list_dead_letters(&DeadLetterFilter::default(), 0, 10)
        .unwrap();
    assert_eq!(listed.len(), 3);
    let id = listed.iter().find(|e| e.message_key == "bad-1").unwrap().id;
    fx.execute(&format!(
        "UPDATE inbox_dead_letters SET reason = 'from_the_future' WHERE id = {id}"
    ));
    // The error and its causes, as an error reporter prints them.
    let chain = |err: &dyn std::error::Error| {
        let mut text = err.to_string();
        let mut cause = err.source();
        while let Some(c) = cause {
            text += &format!(": {c}");
            cause = c.source();
        }
        text
    };
    let unknown = |err: Error| {
        let text = chain(&err);
        assert!(
            text.contains(&format!("dead letter {id}")) && text.contains("\"from_the_future\""),
            "{text}"
        );
    };
    unknown(
        op.list_dead_letters(&DeadLetterFilter::default(), 0, 10)
            .unwrap_err(),
    );
    unknown(op.failure_groups(&DeadLetterFilter::default()).unwrap_err());
    unknown(op.dead_letter_details(id).unwrap_err());
    unknown(
        op.replay_dead_letter(id, &ReplayTarget::default())
            .unwrap_err(),
    );
    let err = chain(&op.operator_stats().unwrap_err());
    assert!(
        err.contains("dead letters of billing.daily-usage") && err.contains("from_the_future"),
        "{err}"
    );
    // Narrowed to a known reason, the other letters list as before.
    let known = op
        .list_dead_letters(
            &DeadLetterFilter::default().reason(DeadLetterReason::MaxAttempts),
            0,
            10,
        )
        .unwrap();
    assert_eq!(known.len(), 2);
    assert!(known
        .iter()
        .all(|e| e.reason == DeadLetterReason::MaxAttempts));
}

on_both_backends!(
    a_stored_reason_this_version_does_not_know_fails_loudly,
    a_halt_is_recorded_listed_and_resumed_once,
    gauges_show_backlog_unprocessed_age_failure_groups_and_replays,
    a_vanished_failure_group_gauge_goes_back_to_zero,
    a_letter_of_another_payload_never_takes_the_claim,
    replays_reach_the_failing_group_alone_and_apply_once,
    one_letter_replayed_twice_and_twice_at_once_is_enqueued_once,
    a_message_failing_again_after_a_replay_is_dead_again_with_its_replay_visible,
    reasons_that_cannot_be_replayed_are_refused_and_no_handler_is_replayed_once_handled,
    discard_bulk_limits_and_stats,
    a_failed_claim_whose_retry_copy_was_lost_is_redriven_once,
    a_producer_row_and_replays_of_its_key_share_the_outbox,
    verify_schema_refuses_an_outbox_that_cannot_hold_replays,
);

#[test]
fn the_unique_key_pair_is_required_on_postgres() {
    let Some(fx) = inbox_test_support::PgFixture::new() else {
        return;
    };
    let store = fx.builder().build().unwrap();
    drop(store);
    fx.execute("ALTER TABLE outbox_messages DROP CONSTRAINT outbox_messages_key_replay");
    let err = fx.builder().build().unwrap_err();
    assert!(
        matches!(&err, Error::SchemaMismatch { part: inbox_diesel::SchemaPart::Operator, expected, found, .. }
            if expected == "unique (message_key, replay_seq) without predicate, expression or non-deterministic collation"
                && found == "unique (id) [outbox_messages_pkey]"),
        "{err}"
    );
}
