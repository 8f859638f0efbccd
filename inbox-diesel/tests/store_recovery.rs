//! Failures that are not the message's fault: a deadlock inside a handler, and a
//! process that dies mid-message (crash loops), the latter with real child processes.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::PgConnection;
use inbox_core::{
    ClaimKey, ConsumerGroup, DeadLetterReason, Decision, Handler, HandlerError, ManualClock,
    MessageContext, RetryPolicy,
};
use inbox_diesel::ClaimStatus;
use inbox_test_support::claim_key;
use inbox_test_support::{
    group, usage, Fixture, Outcome, PgFixture, Recorder, SqliteFixture, TestConn, Usage,
};

const GROUP: &str = "billing.daily-usage";

fn key(k: &str) -> ClaimKey {
    claim_key(GROUP, k)
}

/// On its first call, takes row 1, lets the test's transaction take row 2 and wait for
/// row 1, then asks for row 2: PostgreSQL picks this handler as the deadlock victim
/// (its deadlock_timeout is the shorter one).
struct Deadlocker {
    group: ConsumerGroup,
    first: AtomicBool,
    holds_row_1: Arc<Barrier>,
    calls: Mutex<u32>,
}

impl Handler<PgConnection> for Deadlocker {
    type Message = Usage;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        "usage.recorded"
    }

    fn handle(
        &self,
        conn: &mut PgConnection,
        msg: Usage,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        *self.calls.lock().unwrap() += 1;
        if self.first.swap(false, Ordering::SeqCst) {
            conn.batch_execute(
                "SET LOCAL deadlock_timeout = '50ms'; UPDATE locks SET v = v + 1 WHERE id = 1",
            )?;
            self.holds_row_1.wait();
            // Give the other transaction time to block on row 1.
            std::thread::sleep(Duration::from_millis(300));
            conn.batch_execute("UPDATE locks SET v = v + 1 WHERE id = 2")?;
        }
        conn.record_effect(ctx.message_key().as_str(), msg.amount)?;
        Ok(())
    }
}

#[test]
fn deadlock_inside_a_handler_retries_the_batch_without_counting() {
    let Some(fx) = PgFixture::new() else { return };
    let barrier = Arc::new(Barrier::new(2));
    let handler = Arc::new(Deadlocker {
        group: group(GROUP),
        first: AtomicBool::new(true),
        holds_row_1: Arc::clone(&barrier),
        calls: Mutex::new(0),
    });
    let store = fx
        .builder()
        .dyn_handler(handler.clone())
        .build()
        .expect("store");
    fx.execute("CREATE TABLE locks (id INT PRIMARY KEY, v INT NOT NULL); INSERT INTO locks VALUES (1, 0), (2, 0);");
    fx.connect().create_effects().unwrap();

    let mut other = fx.connect();
    let other_side = std::thread::spawn(move || {
        other
            .batch_execute("BEGIN; SET LOCAL deadlock_timeout = '10s'; UPDATE locks SET v = v + 1 WHERE id = 2")
            .unwrap();
        barrier.wait();
        // Blocks on row 1 until the handler's transaction is rolled back.
        other
            .batch_execute("UPDATE locks SET v = v + 1 WHERE id = 1; COMMIT")
            .unwrap();
    });

    // One message: it runs in its savepoint at once, so only the deadlock guard (not
    // the optimistic-then-isolated rerun) can keep the deadlock from counting.
    let decisions = store
        .process_batch(&group(GROUP), &[usage("dl", 3)])
        .unwrap();
    other_side.join().unwrap();
    assert_eq!(decisions, [Decision::Processed]);
    assert_eq!(
        *handler.calls.lock().unwrap(),
        2,
        "the batch ran again after the deadlock"
    );
    let claim = store.claim(&key("dl")).unwrap().unwrap();
    assert_eq!(
        (claim.status, claim.attempts),
        (ClaimStatus::Done, 0),
        "no attempt counted"
    );
    assert_eq!(claim.last_error, None);
    assert_eq!(fx.connect().effects_of("dl").unwrap(), 1);
}

// ---- crash loops, with real processes ----

const CHILD_ENV: &str = "INBOX_CRASH_CHILD";

/// Not a test of its own: the body of a child process the crash tests start. It
/// processes one delivery with a handler that aborts the process.
#[test]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.splitn(4, '|').collect();
    let [backend, location, key, redelivered] = parts[..] else {
        panic!("bad child spec {spec}");
    };
    let handler = Recorder::new(GROUP).behaviour(|_, _| std::process::abort());
    let mut env = usage(key, 1);
    env.redelivered = redelivered == "true";
    let decisions = match backend {
        "postgres" => inbox_diesel::Store::<PgConnection>::builder(
            inbox_test_support::postgres_url().unwrap(),
        )
        .schema(location)
        .handler(handler)
        .build()
        .unwrap()
        .process_batch(&group(GROUP), &[env]),
        _ => inbox_diesel::Store::<diesel::SqliteConnection>::builder(location)
            .handler(handler)
            .build()
            .unwrap()
            .process_batch(&group(GROUP), &[env]),
    };
    // Reaching this line means the handler did not run (no crash).
    println!("child decided {decisions:?}");
}

/// Runs `crash_child` in a child process; returns whether it crashed.
fn crash_in_child(backend: &str, location: &str, key: &str, redelivered: bool) -> bool {
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(
            CHILD_ENV,
            format!("{backend}|{location}|{key}|{redelivered}"),
        )
        .status()
        .expect("spawn child");
    !status.success()
}

fn crash_loop_is_dead_lettered<F: Fixture>(fx: &F, backend: &str, location: &str) {
    let clock = ManualClock::new("2026-11-30T12:00:00Z".parse::<DateTime<Utc>>().unwrap());
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(
        fx.builder()
            .clock(Arc::new(clock))
            .crash_limit(3)
            .handler(handler),
    );
    let g = group(GROUP);

    // A first delivery that crashes commits nothing, no mark either.
    assert!(crash_in_child(backend, location, "poison", false));
    assert_eq!(store.claim(&key("poison")).unwrap(), None);

    // Redeliveries: each commits a start mark, then dies before any outcome.
    for starts in 1..=3 {
        assert!(
            crash_in_child(backend, location, "poison", true),
            "child {starts} crashed"
        );
        let claim = store
            .claim(&key("poison"))
            .unwrap()
            .expect("mark committed");
        assert_eq!(
            (claim.status, claim.starts, claim.attempts),
            (ClaimStatus::Started, starts, 0)
        );
        assert!(claim.has_payload, "a started claim keeps its payload");
    }

    // The next redelivery is dead-lettered without its handler running.
    let decision = store
        .process_batch(&g, &[usage("poison", 1).redelivered()])
        .unwrap();
    assert_eq!(
        decision,
        [Decision::DeadLettered(DeadLetterReason::CrashLoop)]
    );
    assert!(calls.lock().unwrap().is_empty());
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, "crash_loop");
    assert_eq!(dead[0].payload, usage("poison", 1).payload);
    assert_eq!(
        store.claim(&key("poison")).unwrap().unwrap().status,
        ClaimStatus::Dead
    );

    // A message in flight during a crash, redelivered once, is processed normally.
    let decision = store
        .process_batch(&g, &[usage("bystander", 1).redelivered()])
        .unwrap();
    assert_eq!(decision, [Decision::Processed]);
    assert_eq!(fx.connect().effects_of("bystander").unwrap(), 1);
}

#[test]
fn postgres_crash_loop_is_dead_lettered() {
    let Some(fx) = PgFixture::new() else { return };
    let schema = fx.schema.clone();
    crash_loop_is_dead_lettered(&fx, "postgres", &schema);
}

#[test]
fn sqlite_crash_loop_is_dead_lettered() {
    let fx = SqliteFixture::new();
    let path = fx.path.clone();
    crash_loop_is_dead_lettered(&fx, "sqlite", &path);
}

/// Redeliveries of done, dead and not-yet-due messages take their ordinary decision
/// and commit no start mark; a first delivery commits none either.
fn redeliveries_of_settled_messages_commit_no_mark<F: Fixture>(fx: &F) {
    let clock = ManualClock::new("2026-11-30T12:00:00Z".parse::<DateTime<Utc>>().unwrap());
    let policy = RetryPolicy::new(5, Duration::from_secs(60), Duration::from_secs(60)).unwrap();
    let handler = Recorder::new(GROUP)
        .policy(policy)
        .behaviour(|key, _| match key {
            "fails" => Outcome::ApplyThenFail,
            "bad" => Outcome::Permanent,
            _ => Outcome::Apply,
        });
    let calls = handler.calls();
    let store = fx.open(fx.builder().clock(Arc::new(clock)).handler(handler));
    let g = group(GROUP);
    let first = store
        .process_batch(&g, &[usage("ok", 1), usage("bad", 1), usage("fails", 1)])
        .unwrap();
    assert_eq!(first[0], Decision::Processed);
    assert_eq!(
        first[1],
        Decision::DeadLettered(DeadLetterReason::Permanent)
    );
    assert!(matches!(first[2], Decision::RetryAfter(_)));
    for k in ["ok", "bad", "fails"] {
        assert_eq!(
            store.claim(&key(k)).unwrap().unwrap().starts,
            0,
            "first delivery of {k} left a mark"
        );
    }
    let calls_before = calls.lock().unwrap().len();

    let again = store
        .process_batch(
            &g,
            &[
                usage("ok", 1).redelivered(),
                usage("bad", 1).redelivered(),
                usage("fails", 1).redelivered(),
            ],
        )
        .unwrap();
    assert_eq!(again[0], Decision::Duplicate);
    assert_eq!(again[1], Decision::AlreadyDeadLettered);
    assert_eq!(again[2], Decision::RetryAfter(Duration::from_secs(60)));
    assert_eq!(calls.lock().unwrap().len(), calls_before, "no handler ran");
    for k in ["ok", "bad", "fails"] {
        assert_eq!(
            store.claim(&key(k)).unwrap().unwrap().starts,
            0,
            "redelivery of {k} left a mark"
        );
    }
    assert_eq!(
        store.claim(&key("fails")).unwrap().unwrap().status,
        ClaimStatus::Failed
    );
}

#[test]
fn postgres_redeliveries_of_settled_messages_commit_no_mark() {
    if let Some(fx) = PgFixture::new() {
        redeliveries_of_settled_messages_commit_no_mark(&fx);
    }
}

#[test]
fn sqlite_redeliveries_of_settled_messages_commit_no_mark() {
    redeliveries_of_settled_messages_commit_no_mark(&SqliteFixture::new());
}

#[test]
fn sqlite_busy_is_retried_not_counted() {
    // A writer outside the store holds the file's write lock longer than busy_timeout
    // lets the store wait; the store retries the batch and it then commits.
    let fx = SqliteFixture::new();
    let handler = Recorder::new(GROUP);
    let store = fx.open(
        fx.builder()
            .transaction_retries(50)
            .pool_size(1)
            .handler(handler),
    );
    let mut blocker = fx.connect();
    blocker
        .batch_execute("PRAGMA busy_timeout = 0; BEGIN IMMEDIATE;")
        .unwrap();
    // The pool's only connection gives up at once instead of waiting 5 s.
    store
        .connection()
        .unwrap()
        .batch_execute("PRAGMA busy_timeout = 0")
        .unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        blocker.batch_execute("COMMIT").unwrap();
    });
    let decisions = store
        .process_batch(&group(GROUP), &[usage("busy", 1)])
        .unwrap();
    release.join().unwrap();
    assert_eq!(decisions, [Decision::Processed]);
    let claim = store.claim(&key("busy")).unwrap().unwrap();
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Done, 0));
}

#[test]
fn sqlite_busy_past_the_retries_defers_the_batch_uncounted() {
    // The writer lock is held for the whole call: every try fails. The store retries
    // the batch (bounded), splits it, retries each half, and finally defers each
    // delivery without counting an attempt or leaving a claim behind.
    let fx = SqliteFixture::new();
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(
        fx.builder()
            .transaction_retries(1)
            .pool_size(1)
            .handler(handler),
    );
    store
        .connection()
        .unwrap()
        .batch_execute("PRAGMA busy_timeout = 0")
        .unwrap();
    let mut blocker = fx.connect();
    blocker
        .batch_execute("PRAGMA busy_timeout = 0; BEGIN IMMEDIATE;")
        .unwrap();
    let decisions = store
        .process_batch(&group(GROUP), &[usage("a", 1), usage("b", 1)])
        .unwrap();
    blocker.batch_execute("ROLLBACK").unwrap();
    assert_eq!(
        decisions,
        [
            Decision::RetryAfter(Duration::from_secs(1)),
            Decision::RetryAfter(Duration::from_secs(1))
        ]
    );
    assert!(calls.lock().unwrap().is_empty());
    assert_eq!(store.claim(&key("a")).unwrap(), None, "nothing recorded");
    assert_eq!(store.claim(&key("b")).unwrap(), None);
    // Once the writer is gone, the same deliveries go through, attempts untouched.
    let decisions = store
        .process_batch(&group(GROUP), &[usage("a", 1), usage("b", 1)])
        .unwrap();
    assert_eq!(decisions, [Decision::Processed, Decision::Processed]);
    assert_eq!(store.claim(&key("a")).unwrap().unwrap().attempts, 0);
}

/// Folds, but a fold of more than one message always deadlocks: only a split batch
/// can get through.
struct DeadlocksWhenBatched(ConsumerGroup);

impl<C: TestConn + Send + 'static> Handler<C> for DeadlocksWhenBatched {
    type Message = Usage;

    fn group(&self) -> &ConsumerGroup {
        &self.0
    }

    fn message_type(&self) -> &str {
        "usage.recorded"
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: Usage,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        conn.record_effect(ctx.message_key().as_str(), msg.amount)?;
        Ok(())
    }

    fn fold(
        &self,
        conn: &mut C,
        batch: &[(Usage, MessageContext<'_>)],
    ) -> Option<Result<(), HandlerError>> {
        if batch.len() > 1 {
            let deadlock = diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::Unknown,
                Box::new("deadlock detected".to_owned()),
            );
            return Some(Err(deadlock.into()));
        }
        let (msg, ctx) = &batch[0];
        Some(
            conn.record_effect(ctx.message_key().as_str(), msg.amount)
                .map_err(Into::into),
        )
    }
}

#[test]
fn a_batch_that_keeps_deadlocking_is_split() {
    let fx = SqliteFixture::new();
    let store = fx.open(
        fx.builder()
            .transaction_retries(2)
            .handler(DeadlocksWhenBatched(group(GROUP))),
    );
    let batch: Vec<_> = (0..4).map(|i| usage(&format!("s{i}"), 1)).collect();
    let decisions = store.process_batch(&group(GROUP), &batch).unwrap();
    assert!(
        decisions.iter().all(|d| *d == Decision::Processed),
        "{decisions:?}"
    );
    let mut conn = fx.connect();
    for i in 0..4 {
        assert_eq!(conn.effects_of(&format!("s{i}")).unwrap(), 1);
        let claim = store.claim(&key(&format!("s{i}"))).unwrap().unwrap();
        assert_eq!(claim.attempts, 0, "a deadlock is not the message's fault");
    }
}
