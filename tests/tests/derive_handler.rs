//! `#[derive(Handler)]` against a hand-written `Handler` impl of the same handler:
//! same group, message type, retry policy and lock, and in the inbox the same
//! decisions, claims, dead letters, effects and hook calls, on SQLite and PostgreSQL.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::{PgConnection, SqliteConnection};
use inbox_core::{
    ClaimKey, ConsumerGroup, DeadLetterReason, Decision, DynHandler, Envelope, Handler,
    HandlerError, InProcessTransport, ManualClock, MessageContext, MessageKey, ProjectionLock,
    RetryPolicy, TransportStats,
};
use inbox_diesel::{ClaimRecord, DeadLetter};
use inbox_test_support::start_time;
use inbox_test_support::{usage, Fixture, TestConn, Usage};

const GROUP: &str = "billing.derive-check";

/// Counts of hook calls, shared with the test.
#[derive(Clone, Default)]
struct Calls {
    handle: Arc<AtomicUsize>,
    fold: Arc<AtomicUsize>,
}

impl Calls {
    fn counts(&self) -> (usize, usize) {
        (
            self.handle.load(Ordering::SeqCst),
            self.fold.load(Ordering::SeqCst),
        )
    }
}

/// The handler's logic, shared by both versions, so the test compares the wiring:
/// a positive amount is applied, 0 writes and then fails (transient), a negative
/// amount is refused (permanent), 13 panics.
fn apply<C: TestConn>(
    conn: &mut C,
    msg: &Usage,
    ctx: &MessageContext<'_>,
) -> Result<(), HandlerError> {
    let key = ctx.message_key().as_str();
    match msg.amount {
        13 => panic!("unlucky {key}"),
        n if n < 0 => Err(HandlerError::permanent(format!("{key}: negative amount"))),
        0 => {
            conn.record_effect(key, 0)?;
            Err(HandlerError::transient(format!(
                "{key} failed after writing"
            )))
        }
        n => Ok(conn.record_effect(key, n)?),
    }
}

fn policy() -> RetryPolicy {
    RetryPolicy::new(3, Duration::from_secs(10), Duration::from_secs(25)).unwrap()
}

/// The hand-written version.
struct HandWritten {
    group: ConsumerGroup,
    calls: Calls,
}

impl<C: TestConn + Send + 'static> Handler<C> for HandWritten {
    type Message = Usage;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        "usage.recorded"
    }

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: Usage,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        self.calls.handle.fetch_add(1, Ordering::SeqCst);
        apply(conn, &msg, ctx)
    }

    fn fold(
        &self,
        conn: &mut C,
        batch: &[(Usage, MessageContext<'_>)],
    ) -> Option<Result<(), HandlerError>> {
        self.calls.fold.fetch_add(1, Ordering::SeqCst);
        Some(
            batch
                .iter()
                .try_for_each(|(msg, ctx)| apply(conn, msg, ctx)),
        )
    }

    fn lock(&self) -> Option<ProjectionLock> {
        Some(ProjectionLock::named("effects"))
    }
}

/// The derived version: the same handler in attributes.
#[derive(Handler)]
#[inbox(
    group = "billing.derive-check",
    message = Usage,
    message_type = "usage.recorded",
    connection = [SqliteConnection, PgConnection],
    max_attempts = 3,
    backoff(initial = "10s", max = "25s"),
    fold = Self::apply_all,
    lock = Self::effects_lock,
)]
struct Derived {
    calls: Calls,
}

impl Derived {
    fn handle<C: TestConn>(
        &self,
        conn: &mut C,
        msg: Usage,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        self.calls.handle.fetch_add(1, Ordering::SeqCst);
        apply(conn, &msg, ctx)
    }

    fn apply_all<C: TestConn>(
        &self,
        conn: &mut C,
        batch: &[(Usage, MessageContext<'_>)],
    ) -> Result<(), HandlerError> {
        self.calls.fold.fetch_add(1, Ordering::SeqCst);
        batch
            .iter()
            .try_for_each(|(msg, ctx)| apply(conn, msg, ctx))
    }

    fn effects_lock(&self) -> ProjectionLock {
        ProjectionLock::named("effects")
    }
}

fn hand_written(calls: &Calls) -> HandWritten {
    HandWritten {
        group: ConsumerGroup::new(GROUP).unwrap(),
        calls: calls.clone(),
    }
}

fn derived(calls: &Calls) -> Derived {
    Derived {
        calls: calls.clone(),
    }
}

const KEYS: [&str; 9] = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];

/// Everything observable about one run.
#[derive(Debug, PartialEq)]
struct Trace {
    decisions: Vec<Vec<Decision>>,
    claims: Vec<Option<ClaimRecord>>,
    dead_letters: Vec<DeadLetter>,
    effects: Vec<i64>,
    calls: (usize, usize),
}

fn trace<F: Fixture>(
    fx: &F,
    store: &inbox_diesel::Store<F::Conn>,
    decisions: Vec<Vec<Decision>>,
    calls: &Calls,
) -> Trace {
    let g = ConsumerGroup::new(GROUP).unwrap();
    let mut conn = fx.connect();
    Trace {
        decisions,
        claims: KEYS
            .iter()
            .map(|k| {
                let key = ClaimKey::new(g.clone(), MessageKey::new(*k).unwrap());
                store.claim(&key).unwrap()
            })
            .collect(),
        dead_letters: store.dead_letters(&g).unwrap(),
        effects: KEYS.iter().map(|k| conn.effects_of(k).unwrap()).collect(),
        calls: calls.counts(),
    }
}

/// A fixed sequence of batches straight into the store, on a manual clock.
fn store_scenario<F: Fixture, H: Handler<F::Conn>>(fx: &F, make: fn(&Calls) -> H) -> Trace {
    let calls = Calls::default();
    let clock = ManualClock::new(start_time());
    let store = fx.open(
        fx.builder()
            .clock(Arc::new(clock.clone()))
            .handler(make(&calls)),
    );
    let g = ConsumerGroup::new(GROUP).unwrap();
    let undecodable = Envelope::new(
        MessageKey::new("f").unwrap(),
        "usage.recorded",
        b"not json".to_vec(),
    );

    let mut decisions = Vec::new();
    let mut run = |batch: &[Envelope]| decisions.push(store.process_batch(&g, batch).unwrap());
    run(&[usage("a", 5), usage("b", 7)]); // folded
    run(&[usage("a", 5)]); // duplicate
    run(&[usage("c", 0), usage("d", 3), usage("i", 13)]); // fold fails: one at a time
    run(&[usage("c", 0)]); // not due yet
    clock.advance(Duration::from_secs(10));
    run(&[usage("c", 0)]);
    clock.advance(Duration::from_secs(20));
    run(&[usage("c", 0)]); // third failure: dead
    run(&[usage("c", 0)]);
    run(&[usage("e", -1)]);
    run(&[undecodable]);
    run(&[usage("a", 6)]); // same key, other payload
    run(&[usage("g", 2).redelivered(), usage("h", 1)]);
    trace(fx, &store, decisions, &calls)
}

/// A workload with copies, redeliveries and poison through the in-process transport.
fn transport_scenario<F: Fixture, H: Handler<F::Conn>>(
    fx: &F,
    make: fn(&Calls) -> H,
) -> (TransportStats, Trace) {
    let calls = Calls::default();
    let clock = ManualClock::new(start_time());
    let store = fx.open(
        fx.builder()
            .clock(Arc::new(clock.clone()))
            .handler(make(&calls)),
    );
    let mut transport = InProcessTransport::new(store.clone())
        .with_clock(Arc::new(clock))
        .batch_size(4);
    let amounts = [4, 0, 9, -2, 3, 13, 8, 1, 6];
    for (key, amount) in KEYS.iter().zip(amounts) {
        transport.publish(usage(key, amount)).unwrap();
        if amount % 3 == 0 {
            transport.publish(usage(key, amount).redelivered()).unwrap();
        }
        if amount % 4 == 0 {
            transport.publish(usage(key, amount)).unwrap();
        }
    }
    let stats = transport.run_until_idle().unwrap();
    (stats, trace(fx, &store, Vec::new(), &calls))
}

fn same_in_the_store<F: Fixture>(fx_hand: &F, fx_derived: &F)
where
    Derived: Handler<F::Conn>,
{
    let hand = store_scenario(fx_hand, hand_written);
    let derived = store_scenario(fx_derived, derived);
    assert_eq!(derived, hand);

    // And it is the behaviour intended, not merely the same.
    use Decision::*;
    let retry = |s| RetryAfter(Duration::from_secs(s));
    assert_eq!(
        hand.decisions,
        [
            vec![Processed, Processed],
            vec![Duplicate],
            vec![retry(10), Processed, retry(10)],
            vec![retry(10)],
            vec![retry(20)],
            vec![DeadLettered(DeadLetterReason::MaxAttempts)],
            vec![AlreadyDeadLettered],
            vec![DeadLettered(DeadLetterReason::Permanent)],
            vec![DeadLettered(DeadLetterReason::DecodeError)],
            vec![DeadLettered(DeadLetterReason::KeyCollision)],
            vec![Processed, Processed],
        ]
    );
    assert_eq!(hand.effects, [1, 1, 0, 1, 0, 0, 1, 1, 0]);
    assert!(hand.calls.1 > 0, "the fold path ran: {:?}", hand.calls);
}

fn same_through_the_transport<F: Fixture>(fx_hand: &F, fx_derived: &F)
where
    Derived: Handler<F::Conn>,
{
    let hand = transport_scenario(fx_hand, hand_written);
    let derived = transport_scenario(fx_derived, derived);
    assert_eq!(derived, hand);
    let (stats, trace) = hand;
    assert_eq!(stats.processed, 6, "{stats:?}");
    assert_eq!(stats.dead_lettered, 3, "{stats:?}");
    assert!(stats.duplicates > 0 && stats.retries > 0, "{stats:?}");
    assert_eq!(trace.dead_letters.len(), 3);
}

#[test]
fn same_group_type_policy_and_lock() {
    fn metadata<C, H: DynHandler<C>>(
        h: &H,
    ) -> (String, String, RetryPolicy, Option<ProjectionLock>) {
        (
            h.group().to_string(),
            h.message_type().to_owned(),
            h.retry_policy(),
            h.lock(),
        )
    }
    let calls = Calls::default();
    let (hand, derived) = (hand_written(&calls), derived(&calls));
    let expected = (
        GROUP.to_owned(),
        "usage.recorded".to_owned(),
        policy(),
        Some(ProjectionLock::named("effects")),
    );
    assert_eq!(metadata::<SqliteConnection, _>(&hand), expected);
    assert_eq!(metadata::<SqliteConnection, _>(&derived), expected);
    assert_eq!(metadata::<PgConnection, _>(&derived), expected);
}

#[test]
fn the_quickstart_handler_keeps_its_contract() {
    use inbox_examples::usage::{quick_policy, DailyUsage, GROUP, MESSAGE_TYPE};
    let handler = DailyUsage::new(quick_policy());
    for (group, message_type, policy, lock) in [
        (
            Handler::<SqliteConnection>::group(&handler),
            Handler::<SqliteConnection>::message_type(&handler),
            Handler::<SqliteConnection>::retry_policy(&handler),
            Handler::<SqliteConnection>::lock(&handler),
        ),
        (
            Handler::<PgConnection>::group(&handler),
            Handler::<PgConnection>::message_type(&handler),
            Handler::<PgConnection>::retry_policy(&handler),
            Handler::<PgConnection>::lock(&handler),
        ),
    ] {
        assert_eq!(group.as_str(), GROUP);
        assert_eq!(message_type, MESSAGE_TYPE);
        assert_eq!(policy, quick_policy());
        assert_eq!(lock, Some(ProjectionLock::named("daily_usage")));
    }
}

mod sqlite {
    use inbox_test_support::SqliteFixture;

    #[test]
    fn same_in_the_store() {
        super::same_in_the_store(&SqliteFixture::new(), &SqliteFixture::new());
    }

    #[test]
    fn same_through_the_transport() {
        super::same_through_the_transport(&SqliteFixture::new(), &SqliteFixture::new());
    }
}

mod postgres {
    use inbox_test_support::PgFixture;

    #[test]
    fn same_in_the_store() {
        if let (Some(a), Some(b)) = (PgFixture::new(), PgFixture::new()) {
            super::same_in_the_store(&a, &b);
        }
    }

    #[test]
    fn same_through_the_transport() {
        if let (Some(a), Some(b)) = (PgFixture::new(), PgFixture::new()) {
            super::same_through_the_transport(&a, &b);
        }
    }
}
