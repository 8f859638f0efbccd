//! Dead letters the broker hands over (`delivery_limit`): what they record, and that a
//! message a worker is committing at that moment is reported done, not dead-lettered.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::BigInt;
use inbox_core::{ClaimKey, DeadLetterOutcome, DeadLetterReason, Decision, Envelope, InboxStore};
use inbox_diesel::ClaimStatus;
use inbox_test_support::claim_key;
use inbox_test_support::{group, usage, Fixture, Outcome, PgFixture, Recorder, TestConn};

const GROUP: &str = "billing.daily-usage";

fn key(k: &str) -> ClaimKey {
    claim_key(GROUP, k)
}

fn delivered(env: Envelope, count: Option<u32>) -> Envelope {
    Envelope {
        delivery_count: count,
        ..env
    }
}

inbox_test_support::on_both_backends!(delivery_limit_dead_letters_record_the_attempts_known);

/// The larger of the claim's handled failures and the broker's deliveries.
fn delivery_limit_dead_letters_record_the_attempts_known<F: Fixture>(fx: &F) {
    let handler = Recorder::new(GROUP).behaviour(|k, _| {
        if k.starts_with("failing") {
            Outcome::ApplyThenFail
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    let decisions = store
        .process_batch(&g, &[usage("failing-a", 1), usage("failing-b", 1)])
        .unwrap();
    assert!(decisions
        .iter()
        .all(|d| matches!(d, Decision::RetryAfter(_))));

    let limit = |env: Envelope| {
        store
            .dead_letter(&g, &env, DeadLetterReason::DeliveryLimit, "limit")
            .unwrap()
    };
    // One handled failure, no delivery count from the broker.
    assert_eq!(
        limit(delivered(usage("failing-a", 1), None)),
        DeadLetterOutcome::Recorded
    );
    // One handled failure, four deliveries.
    assert_eq!(
        limit(delivered(usage("failing-b", 1), Some(4))),
        DeadLetterOutcome::Recorded
    );
    // Never claimed: what the broker counted.
    assert_eq!(
        limit(delivered(usage("unseen", 1), Some(21))),
        DeadLetterOutcome::Recorded
    );
    let attempts: Vec<(String, i32)> = store
        .dead_letters(&g)
        .unwrap()
        .into_iter()
        .map(|d| (d.key, d.attempts))
        .collect();
    assert_eq!(
        attempts,
        [
            ("failing-a".to_owned(), 1),
            ("failing-b".to_owned(), 4),
            ("unseen".to_owned(), 21)
        ]
    );
    assert_eq!(
        store.claim(&key("failing-b")).unwrap().unwrap().status,
        ClaimStatus::Dead
    );
}

#[derive(QueryableByName)]
struct Waiting {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Backends blocked by another while holding a lock on this schema's claim table.
fn blocked_on_claims(fx: &PgFixture) -> i64 {
    let mut conn = fx.connect();
    diesel::sql_query(format!(
        "SELECT count(DISTINCT l.pid) AS n FROM pg_locks l \
         WHERE l.relation = to_regclass('\"{}\".inbox_claims') \
           AND cardinality(pg_blocking_pids(l.pid)) > 0",
        fx.schema
    ))
    .get_result::<Waiting>(&mut conn)
    .unwrap()
    .n
}

/// A worker holds its uncommitted `done` claim while the broker's dead letter of the
/// same message arrives: the dead-letter write waits for the worker, and once the
/// worker commits, the message is done and no dead letter is written.
#[test]
fn a_broker_dead_letter_waiting_on_a_committing_worker_reports_already_done() {
    let Some(fx) = PgFixture::new() else { return };
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let entered = Mutex::new(entered_tx);
    let release = Mutex::new(release_rx);
    let handler = Recorder::new(GROUP).behaviour(move |_, _| {
        // Inside the batch transaction, after the claim: hold it open.
        entered.lock().unwrap().send(()).unwrap();
        release
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(30))
            .unwrap();
        Outcome::Apply
    });
    let store = Arc::new(fx.builder().pool_size(4).handler(handler).build().unwrap());
    fx.connect().create_effects().unwrap();
    let g = group(GROUP);

    let worker = {
        let store = Arc::clone(&store);
        let g = g.clone();
        std::thread::spawn(move || store.process_batch(&g, &[usage("racing", 7)]))
    };
    entered_rx.recv_timeout(Duration::from_secs(30)).unwrap();

    let reader = {
        let store = Arc::clone(&store);
        let g = g.clone();
        std::thread::spawn(move || {
            store.dead_letter(
                &g,
                &delivered(usage("racing", 7), Some(21)),
                DeadLetterReason::DeliveryLimit,
                "the broker gave up",
            )
        })
    };
    // The dead-letter call is blocked by the worker's open transaction.
    let deadline = Instant::now() + Duration::from_secs(30);
    while blocked_on_claims(&fx) == 0 {
        assert!(
            Instant::now() < deadline,
            "the dead-letter call never waited on the worker"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    release_tx.send(()).unwrap();

    assert_eq!(worker.join().unwrap().unwrap(), [Decision::Processed]);
    assert_eq!(
        reader.join().unwrap().unwrap(),
        DeadLetterOutcome::AlreadyDone
    );
    assert!(store.dead_letters(&g).unwrap().is_empty());
    let claim = store.claim(&key("racing")).unwrap().unwrap();
    assert_eq!(claim.status, ClaimStatus::Done);
    assert_eq!(fx.connect().effects_of("racing").unwrap(), 1);
}
