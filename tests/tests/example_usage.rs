//! The example's projection against its message contract, on PostgreSQL and SQLite:
//! strict decoding, and totals that never overflow silently.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use chrono::{NaiveDate, Utc};
use diesel::prelude::*;
use diesel::SqliteConnection;
use inbox_core::{
    ConsumerGroup, DeadLetterReason, Decision, Envelope, Handler, HandlerErrorKind, MessageContext,
    MessageKey, RetryPolicy,
};
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, GROUP, MESSAGE_TYPE};
use inbox_test_support::Fixture;

inbox_test_support::on_both_backends!(
    a_total_that_would_overflow_dead_letters_the_event_that_overflows_it,
    the_contract_is_decoded_strictly,
);

const BIG: i64 = 4_000_000_000_000_000_000;

fn day() -> NaiveDate {
    NaiveDate::from_ymd_opt(2026, 11, 30).unwrap()
}

fn envelope(key: &str, body: &[u8]) -> Envelope {
    Envelope::new(MessageKey::new(key).unwrap(), MESSAGE_TYPE, body.to_vec())
}

fn event(key: &str, amount: i64) -> Envelope {
    let body = serde_json::to_vec(&UsageRecorded {
        user_id: 1,
        day: day(),
        amount,
    })
    .unwrap();
    envelope(key, &body)
}

fn store<F: Fixture>(fx: &F) -> inbox_diesel::Store<F::Conn>
where
    F::Conn: UsageDb,
    DailyUsage: Handler<F::Conn>,
{
    let store = fx
        .builder()
        .handler(DailyUsage::new(RetryPolicy::default()))
        .build()
        .unwrap();
    store.connection().unwrap().create_daily_usage().unwrap();
    store
}

/// Six events of 4e18 on one cell: the fold's sum overflows, the batch runs event by
/// event, and each event that would take the stored total past 2^63 - 1 fails alone,
/// permanently; the total is never wrapped (nor, on SQLite, turned into a REAL).
fn a_total_that_would_overflow_dead_letters_the_event_that_overflows_it<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb,
    DailyUsage: Handler<F::Conn>,
{
    let store = store(fx);
    let g = ConsumerGroup::new(GROUP).unwrap();
    let batch: Vec<Envelope> = (0..6).map(|i| event(&format!("big-{i}"), BIG)).collect();
    let permanent = Decision::DeadLettered(DeadLetterReason::Permanent);
    assert_eq!(
        store.process_batch(&g, &batch).unwrap(),
        [
            Decision::Processed,
            Decision::Processed,
            permanent.clone(),
            permanent.clone(),
            permanent.clone(),
            permanent.clone(),
        ]
    );
    // The fold's own sum fits; the stored total plus it does not.
    assert_eq!(
        store.process_batch(&g, &[event("one-more", BIG)]).unwrap(),
        [permanent]
    );
    let totals = store.connection().unwrap().daily_totals().unwrap();
    assert_eq!(
        totals.into_iter().collect::<Vec<_>>(),
        [((1, day()), 2 * BIG)]
    );
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 5);
    assert!(
        dead.iter()
            .all(|d| d.reason == inbox_core::DeadLetterReason::Permanent),
        "{dead:?}"
    );
}

/// What the contract refuses is a decode error (dead-lettered at once), what it
/// allows is applied.
fn the_contract_is_decoded_strictly<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb,
    DailyUsage: Handler<F::Conn>,
{
    let store = store(fx);
    let g = ConsumerGroup::new(GROUP).unwrap();
    let refused: &[&str] = &[
        r#"{"user_id": 1, "day": "2026-11-3", "amount": 1}"#,
        r#"{"user_id": 1, "day": "2026-1-30", "amount": 1}"#,
        r#"{"user_id": 1, "day": "26-11-30", "amount": 1}"#,
        r#"{"user_id": 1, "day": "+2026-11-30", "amount": 1}"#,
        r#"{"user_id": 1, "day": " 2026-11-30", "amount": 1}"#,
        r#"{"user_id": 1, "day": "2026-11-30 ", "amount": 1}"#,
        r#"{"user_id": 1, "day": "2026-11-30T00:00:00Z", "amount": 1}"#,
        r#"{"user_id": 1, "day": "2026/11/30", "amount": 1}"#,
        r#"{"user_id": 1, "day": "20261130", "amount": 1}"#,
        r#"{"user_id": 1, "day": "2026-02-30", "amount": 1}"#,
        r#"{"user_id": 1, "day": "2026-11-30", "amount": 0}"#,
        r#"{"user_id": 1, "day": "2026-11-30", "amount": -5}"#,
        r#"{"user_id": 1, "day": "2026-11-30", "amount": 40.0}"#,
        r#"{"user_id": 1, "day": "2026-11-30", "amount": 1e3}"#,
        r#"{"user_id": 1, "day": "2026-11-30", "amount": "40"}"#,
        r#"{"user_id": 1, "day": "2026-11-30", "amount": 9223372036854775808}"#,
        r#"{"user_id": "1", "day": "2026-11-30", "amount": 1}"#,
        r#"{"user_id": 1.5, "day": "2026-11-30", "amount": 1}"#,
        r#"{"user_id": 1, "day": "2026-11-30"}"#,
        r#"{"user_id": 1, "day": 20261130, "amount": 1}"#,
    ];
    for (i, body) in refused.iter().enumerate() {
        assert_eq!(
            store
                .process_batch(&g, &[envelope(&format!("refused-{i}"), body.as_bytes())])
                .unwrap(),
            [Decision::DeadLettered(DeadLetterReason::DecodeError)],
            "{body}"
        );
    }
    let allowed: &[&str] = &[
        r#"{"user_id": 1, "day": "2026-11-30", "amount": 40}"#,
        r#"{"user_id": 1, "day": "2024-02-29", "amount": 9223372036854775807}"#,
        r#"{"user_id": -3, "day": "0001-01-01", "amount": 1}"#,
    ];
    for (i, body) in allowed.iter().enumerate() {
        assert_eq!(
            store
                .process_batch(&g, &[envelope(&format!("allowed-{i}"), body.as_bytes())])
                .unwrap(),
            [Decision::Processed],
            "{body}"
        );
    }
    let totals = store.connection().unwrap().daily_totals().unwrap();
    assert_eq!(totals.len(), 3);
    assert_eq!(
        totals[&(1, NaiveDate::from_ymd_opt(2024, 2, 29).unwrap())],
        i64::MAX
    );
}

/// The fold itself: a batch whose sum overflows is a permanent failure, in a debug
/// build as in a release build (where `+=` would wrap).
#[test]
fn the_fold_refuses_a_sum_that_overflows() {
    let mut conn = SqliteConnection::establish(":memory:").unwrap();
    conn.create_daily_usage().unwrap();
    let g = ConsumerGroup::new(GROUP).unwrap();
    let envelopes: Vec<Envelope> = (0..6).map(|i| event(&format!("big-{i}"), BIG)).collect();
    let batch: Vec<(UsageRecorded, MessageContext<'_>)> = envelopes
        .iter()
        .map(|env| {
            let msg = serde_json::from_slice(&env.payload).unwrap();
            (msg, MessageContext::new(env, &g, 1, Utc::now()))
        })
        .collect();
    let handler = DailyUsage::new(RetryPolicy::default());
    let folded =
        Handler::<SqliteConnection>::fold(&handler, &mut conn, &batch).expect("the example folds");
    let err = folded.expect_err("an overflowing sum must fail the fold");
    assert_eq!(err.kind(), HandlerErrorKind::Permanent);
    assert!(conn.daily_totals().unwrap().is_empty(), "nothing written");
}
