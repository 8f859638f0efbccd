//! The outbox against real PostgreSQL and SQLite: enqueue in the caller's
//! transaction, leasing, ordering keys, lease take-over, failures, retention and
//! wake-ups, and the commit order of ordering keys under concurrent producers (races
//! forced with open transactions and threads, a wait observed in `pg_locks`). One
//! schema or file per test, time driven by a manual clock, assertions on stored rows.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeSet;
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use inbox_core::{
    relay_in_process, Clock, Decision, EnqueueOutcome, InProcessTransport, ManualClock, MessageKey,
    OutboxFailure, OutboxFate, OutboxMessage, OutboxStore, Publication,
};
use inbox_diesel::{
    enqueue, enqueue_all, enqueue_with, ordering_lock_stripe, ClaimStatus, EnqueueLimits, Error,
    Retention, Store, StoreConnection, DEFAULT_MAX_OUTBOX_PAYLOAD, ORDERING_LOCK_CLASS,
    ORDERING_LOCK_STRIPES,
};
use inbox_test_support::{
    group, rejected_setting, start_time, usage, Fixture, Outcome, Recorder, TestConn,
};

const GROUP: &str = "billing.daily-usage";
const LEASE: Duration = Duration::from_secs(30);

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn at(offset: Duration) -> DateTime<Utc> {
    start_time() + chrono::Duration::from_std(offset).unwrap()
}

inbox_test_support::on_both_backends!(
    committed_enqueue_is_leased,
    rolled_back_enqueue_never_exists,
    same_key_twice_is_already_enqueued,
    enqueue_refuses_empty_routing_key_type_and_ordering_key,
    leases_in_id_order_and_respects_not_before,
    ordering_key_waits_for_earlier_unpublished_rows,
    expired_lease_is_taken_over_and_the_late_mark_marks_nothing,
    record_failures_advances_attempts_and_delays_the_row,
    lease_refuses_a_zero_lease_and_an_empty_relay,
    oldest_unpublished_age_follows_the_clock,
    retention_deletes_old_published_rows_in_batches,
    retention_deletes_only_old_done_claims,
    enqueue_refuses_what_could_never_be_published_or_read_back,
    unreadable_rows_are_leased_apart_and_never_fail_the_lease,
    a_row_that_fails_its_last_attempt_is_dead_listed_and_holds_up_nothing,
);

fn retry(id: i64, error: &str, after: Duration) -> OutboxFailure {
    OutboxFailure {
        id,
        error: error.to_owned(),
        fate: OutboxFate::RetryAfter(after),
    }
}

fn dead(id: i64, error: &str) -> OutboxFailure {
    OutboxFailure {
        id,
        error: error.to_owned(),
        fate: OutboxFate::Dead,
    }
}

/// Leases as `relay` until the lease holds `expected` rows, for at most 30 s of wall
/// time. An ordered row no longer waits for other transactions of the server, so one
/// lease usually holds them all; the loop keeps the tests honest should that change.
fn lease_at_least<C: StoreConnection>(store: &Store<C>, relay: &str, expected: usize) -> Vec<i64>
where
    Store<C>: OutboxStore,
{
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    let mut leased = Vec::new();
    loop {
        leased.extend(ids(&store.lease(relay, 10, LEASE).unwrap()));
        if leased.len() >= expected || std::time::Instant::now() > give_up {
            leased.sort_unstable();
            return leased;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An outbox row as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    id: i64,
    message_key: String,
    exchange: String,
    attempts: i32,
    available_at: DateTime<Utc>,
    leased_until: Option<DateTime<Utc>>,
    leased_by: Option<String>,
    published_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
}

/// Reads the outbox table behind the store's back.
trait Inspect {
    fn outbox(&mut self) -> Vec<Row>;
}

macro_rules! inspect {
    ($conn:ty, $ts:ty, $module:ident) => {
        mod $module {
            use super::*;
            use diesel::sql_types::{BigInt, Integer, Nullable, Text};

            #[derive(QueryableByName)]
            struct Stored {
                #[diesel(sql_type = BigInt)]
                id: i64,
                #[diesel(sql_type = Text)]
                message_key: String,
                #[diesel(sql_type = Text)]
                exchange: String,
                #[diesel(sql_type = Integer)]
                attempts: i32,
                #[diesel(sql_type = $ts)]
                available_at: DateTime<Utc>,
                #[diesel(sql_type = Nullable<$ts>)]
                leased_until: Option<DateTime<Utc>>,
                #[diesel(sql_type = Nullable<Text>)]
                leased_by: Option<String>,
                #[diesel(sql_type = Nullable<$ts>)]
                published_at: Option<DateTime<Utc>>,
                #[diesel(sql_type = Nullable<Text>)]
                last_error: Option<String>,
            }

            impl Inspect for $conn {
                fn outbox(&mut self) -> Vec<Row> {
                    diesel::sql_query(
                        "SELECT id, message_key, exchange, attempts, available_at, leased_until, \
                         leased_by, published_at, last_error FROM outbox_messages ORDER BY id",
                    )
                    .load::<Stored>(self)
                    .unwrap()
                    .into_iter()
                    .map(|s| Row {
                        id: s.id,
                        message_key: s.message_key,
                        exchange: s.exchange,
                        attempts: s.attempts,
                        available_at: s.available_at,
                        leased_until: s.leased_until,
                        leased_by: s.leased_by,
                        published_at: s.published_at,
                        last_error: s.last_error,
                    })
                    .collect()
                }
            }
        }
    };
}

inspect!(
    diesel::PgConnection,
    diesel::sql_types::Timestamptz,
    pg_inspect
);
inspect!(
    diesel::SqliteConnection,
    diesel::sql_types::TimestamptzSqlite,
    sqlite_inspect
);

fn msg(key: &str) -> OutboxMessage {
    let payload = serde_json::to_vec(&serde_json::json!({ "amount": 40 })).unwrap();
    OutboxMessage::new(
        MessageKey::new(key).unwrap(),
        "billing",
        "usage.recorded",
        payload,
    )
}

fn store_on<F: Fixture>(fx: &F, clock: &ManualClock) -> Store<F::Conn> {
    fx.builder()
        .clock(Arc::new(clock.clone()))
        .build()
        .expect("store")
}

/// Enqueues in a transaction of its own that commits.
fn enqueue_committed<C: StoreConnection>(
    store: &Store<C>,
    message: &OutboxMessage,
) -> EnqueueOutcome {
    let conn: &mut C = &mut store.connection().unwrap();
    conn.transaction(|conn| enqueue(conn, message, store.clock().now()))
        .unwrap()
}

/// Enqueues in a transaction that rolls back after the enqueue succeeded.
fn enqueue_rolled_back<C: StoreConnection>(store: &Store<C>, message: &OutboxMessage) {
    let conn: &mut C = &mut store.connection().unwrap();
    let result = conn.transaction(|conn| {
        let outcome = enqueue(conn, message, store.clock().now())?;
        assert!(matches!(outcome, EnqueueOutcome::Enqueued { .. }));
        // A business rule failed after the enqueue.
        Err::<(), _>(inbox_diesel::Error::Database(
            diesel::result::Error::RollbackTransaction,
        ))
    });
    assert!(result.is_err());
}

fn id_of(outcome: EnqueueOutcome) -> i64 {
    match outcome {
        EnqueueOutcome::Enqueued { id } => id,
        other => panic!("expected a new row, found {other:?}"),
    }
}

fn ids(lease: &inbox_core::Lease) -> Vec<i64> {
    lease.rows.iter().map(|r| r.id).collect()
}

fn committed_enqueue_is_leased<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let message = msg("m1")
        .with_tenant("acme")
        .with_routing_key("usage.recorded.eu")
        .with_ordering_key("user-42");
    let mut message = message;
    message.headers.insert("trace".to_owned(), "abc".to_owned());
    let id = id_of(enqueue_committed(&store, &message));

    // An ordered row: other tests' open transactions may hold it back a moment.
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    let lease = loop {
        let lease = store.lease("relay-1", 10, LEASE).unwrap();
        if !lease.rows.is_empty() || std::time::Instant::now() > give_up {
            break lease;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(lease.relay, "relay-1");
    assert_eq!(lease.until, at(LEASE));
    assert_eq!(lease.rows.len(), 1);
    let row = &lease.rows[0];
    assert_eq!(
        (row.id, row.attempts, row.created_at),
        (id, 0, start_time())
    );
    assert_eq!(row.message, message, "the message reads back as enqueued");

    let stored = fx.connect().outbox();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].leased_by.as_deref(), Some("relay-1"));
    assert_eq!(stored[0].leased_until, Some(at(LEASE)));
    assert_eq!(stored[0].available_at, start_time());
    assert_eq!(stored[0].published_at, None);

    assert_eq!(store.mark_published("relay-1", &[id]).unwrap(), 1);
    let stored = fx.connect().outbox();
    assert_eq!(stored[0].published_at, Some(start_time()));
    assert_eq!(stored[0].leased_until, None);
}

fn rolled_back_enqueue_never_exists<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    enqueue_rolled_back(&store, &msg("m1"));
    assert_eq!(fx.connect().outbox(), []);
    assert!(store.lease("relay-1", 10, LEASE).unwrap().rows.is_empty());
    // The key is free: a later transaction enqueues it.
    id_of(enqueue_committed(&store, &msg("m1")));
}

fn same_key_twice_is_already_enqueued<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    id_of(enqueue_committed(&store, &msg("m1")));
    let mut other = msg("m1");
    other.exchange = "elsewhere".to_owned();
    assert_eq!(
        enqueue_committed(&store, &other),
        EnqueueOutcome::AlreadyEnqueued
    );
    // Also inside one transaction, here on the pooled connection itself.
    let mut conn = store.connection().unwrap();
    let outcomes = conn
        .transaction(|conn| {
            Ok::<_, inbox_diesel::Error>((
                enqueue(conn, &msg("m2"), clock.now())?,
                enqueue(conn, &msg("m2"), clock.now())?,
            ))
        })
        .unwrap();
    assert!(matches!(outcomes.0, EnqueueOutcome::Enqueued { .. }));
    assert_eq!(outcomes.1, EnqueueOutcome::AlreadyEnqueued);
    let stored = fx.connect().outbox();
    let keys: Vec<_> = stored
        .iter()
        .map(|r| (r.message_key.as_str(), r.exchange.as_str()))
        .collect();
    assert_eq!(keys, [("m1", "billing"), ("m2", "billing")]);
}

fn enqueue_refuses_empty_routing_key_type_and_ordering_key<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let mut conn = store.connection().unwrap();
    let cases = [
        (
            msg("a").with_routing_key(""),
            "routing key must not be empty",
        ),
        (
            {
                let mut m = msg("b");
                m.message_type.clear();
                m
            },
            "message type must not be empty",
        ),
        (
            msg("c").with_ordering_key(""),
            "ordering key must not be empty",
        ),
    ];
    for (message, expected) in cases {
        let err = enqueue(&mut *conn, &message, clock.now())
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{err}");
        assert!(err.contains(message.message_key.as_str()), "{err}");
    }
    assert_eq!(fx.connect().outbox(), []);

    // The default exchange is the empty one.
    let mut default_exchange = msg("d");
    default_exchange.exchange.clear();
    id_of(enqueue(&mut *conn, &default_exchange, clock.now()).unwrap());
    let lease = store.lease("relay-1", 10, LEASE).unwrap();
    assert_eq!(lease.rows[0].message.exchange, "");
}

fn leases_in_id_order_and_respects_not_before<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let a = id_of(enqueue_committed(&store, &msg("a")));
    let later = id_of(enqueue_committed(
        &store,
        &msg("later").with_not_before(at(secs(60))),
    ));
    let b = id_of(enqueue_committed(&store, &msg("b")));
    let c = id_of(enqueue_committed(&store, &msg("c")));
    assert!(a < later && later < b && b < c);

    let hour = secs(3600);
    let first = store.lease("relay-1", 2, hour).unwrap();
    assert_eq!(ids(&first), [a, b], "the first two due rows, in id order");
    let second = store.lease("relay-2", 10, hour).unwrap();
    assert_eq!(ids(&second), [c], "leased rows are not leased again");
    assert!(store.lease("relay-3", 10, LEASE).unwrap().rows.is_empty());
    let stored = fx.connect().outbox();
    assert_eq!(stored[1].available_at, at(secs(60)));
    assert_eq!(stored[1].leased_by, None, "not due, not leased");

    clock.advance(secs(59));
    assert!(store.lease("relay-3", 10, LEASE).unwrap().rows.is_empty());
    clock.advance(secs(1));
    let due = store.lease("relay-3", 10, LEASE).unwrap();
    assert_eq!(ids(&due), [later], "due at not_before");
}

fn ordering_key_waits_for_earlier_unpublished_rows<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let k1 = id_of(enqueue_committed(
        &store,
        &msg("k1-1").with_ordering_key("k"),
    ));
    let k2 = id_of(enqueue_committed(
        &store,
        &msg("k1-2").with_ordering_key("k"),
    ));
    let other = id_of(enqueue_committed(
        &store,
        &msg("j-1").with_ordering_key("j"),
    ));
    let free = id_of(enqueue_committed(&store, &msg("free")));

    let lease = lease_at_least(&store, "relay-1", 3);
    assert_eq!(lease, [k1, other, free], "k1-2 waits for k1-1");
    assert!(
        store.lease("relay-2", 10, LEASE).unwrap().rows.is_empty(),
        "another relay does not take k1-2 while k1-1 is leased"
    );

    // k1-1 fails and waits for its retry: k1-2 still waits, for any relay.
    store
        .record_failures("relay-1", &[retry(k1, "broker nacked", secs(30))])
        .unwrap();
    assert!(store.lease("relay-2", 10, LEASE).unwrap().rows.is_empty());
    // Expired leases do not free k1-2 either.
    clock.advance(LEASE);
    let retried = store.lease("relay-2", 10, LEASE).unwrap();
    assert_eq!(ids(&retried), [k1, other, free], "k1-1 again, never k1-2");
    assert!(retried.unreadable.is_empty());

    assert_eq!(store.mark_published("relay-2", &[k1]).unwrap(), 1);
    let next = store.lease("relay-2", 10, LEASE).unwrap();
    assert_eq!(ids(&next), [k2], "k1-2 once k1-1 is published");
}

fn expired_lease_is_taken_over_and_the_late_mark_marks_nothing<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let id = id_of(enqueue_committed(&store, &msg("m1")));
    assert_eq!(ids(&store.lease("relay-a", 10, LEASE).unwrap()), [id]);

    clock.advance(LEASE - secs(1));
    assert!(store.lease("relay-b", 10, LEASE).unwrap().rows.is_empty());
    clock.advance(secs(1));
    let taken = store.lease("relay-b", 10, LEASE).unwrap();
    assert_eq!(ids(&taken), [id], "an expired lease is free");
    assert_eq!(taken.until, at(LEASE * 2));

    assert_eq!(store.mark_published("relay-a", &[id]).unwrap(), 0);
    store
        .record_failures("relay-a", &[retry(id, "late", secs(60))])
        .unwrap();
    let stored = &fx.connect().outbox()[0];
    assert_eq!(
        stored.published_at, None,
        "relay-a's late mark marked nothing"
    );
    assert_eq!(
        (stored.attempts, stored.last_error.as_deref()),
        (0, None),
        "relay-a's late failure recorded nothing"
    );
    assert_eq!(stored.leased_by.as_deref(), Some("relay-b"));
    assert_eq!(stored.leased_until, Some(at(LEASE * 2)));

    assert_eq!(store.mark_published("relay-b", &[id]).unwrap(), 1);
    clock.advance(secs(5));
    assert_eq!(
        store.mark_published("relay-b", &[id]).unwrap(),
        0,
        "a published row is marked once"
    );
    assert_eq!(fx.connect().outbox()[0].published_at, Some(at(LEASE)));
    clock.advance(LEASE * 4);
    assert!(
        store.lease("relay-c", 10, LEASE).unwrap().rows.is_empty(),
        "a published row is never leased again"
    );
}

fn record_failures_advances_attempts_and_delays_the_row<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let a = id_of(enqueue_committed(&store, &msg("a")));
    let b = id_of(enqueue_committed(&store, &msg("b")));
    assert_eq!(ids(&store.lease("relay-1", 10, LEASE).unwrap()), [a, b]);

    clock.advance(secs(2));
    let long_error = "x".repeat(10_000);
    store
        .record_failures(
            "relay-1",
            &[
                retry(a, "channel closed", secs(10)),
                retry(b, &long_error, secs(10)),
            ],
        )
        .unwrap();
    let stored = fx.connect().outbox();
    for row in &stored {
        assert_eq!(row.attempts, 1);
        assert_eq!(row.available_at, at(secs(12)));
        assert_eq!((row.leased_until, row.leased_by.as_deref()), (None, None));
        assert_eq!(row.published_at, None);
    }
    assert_eq!(stored[0].last_error.as_deref(), Some("channel closed"));
    assert_eq!(stored[1].last_error.as_ref().map(String::len), Some(4000));

    clock.advance(secs(9));
    assert!(store.lease("relay-1", 10, LEASE).unwrap().rows.is_empty());
    clock.advance(secs(1));
    let again = store.lease("relay-2", 10, LEASE).unwrap();
    assert_eq!(ids(&again), [a, b]);
    assert_eq!(again.rows[0].attempts, 1);

    // A second failure counts again.
    store
        .record_failures("relay-2", &[retry(a, "still closed", secs(10))])
        .unwrap();
    let stored = fx.connect().outbox();
    assert_eq!(stored[0].attempts, 2);
    assert_eq!(stored[0].last_error.as_deref(), Some("still closed"));
    assert_eq!(stored[1].attempts, 1, "only the failed row");
    assert_eq!(stored[1].leased_by.as_deref(), Some("relay-2"));
}

fn lease_refuses_a_zero_lease_and_an_empty_relay<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    id_of(enqueue_committed(&store, &msg("a")));
    let err = store.lease("relay-1", 10, Duration::ZERO).unwrap_err();
    assert_eq!(rejected_setting(&err), Some("lease_for"), "{err:?}");
    let err = store.lease("", 10, LEASE).unwrap_err();
    assert_eq!(rejected_setting(&err), Some("relay"), "{err:?}");
    assert_eq!(fx.connect().outbox()[0].leased_by, None);
    assert!(store.lease("relay-1", 0, LEASE).unwrap().rows.is_empty());
    assert_eq!(fx.connect().outbox()[0].leased_by, None);
}

fn oldest_unpublished_age_follows_the_clock<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    assert_eq!(store.oldest_unpublished_age().unwrap(), None);
    let a = id_of(enqueue_committed(&store, &msg("a")));
    clock.advance(secs(10));
    let b = id_of(enqueue_committed(&store, &msg("b")));
    clock.advance(secs(32));
    assert_eq!(OutboxStore::now(&store), at(secs(42)));
    assert_eq!(store.oldest_unpublished_age().unwrap(), Some(secs(42)));
    store.lease("relay-1", 10, LEASE).unwrap();
    assert_eq!(store.mark_published("relay-1", &[a]).unwrap(), 1);
    assert_eq!(store.oldest_unpublished_age().unwrap(), Some(secs(32)));
    assert_eq!(store.mark_published("relay-1", &[b]).unwrap(), 1);
    assert_eq!(store.oldest_unpublished_age().unwrap(), None);
}

fn retention_deletes_old_published_rows_in_batches<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let early: Vec<i64> = (0..3)
        .map(|i| id_of(enqueue_committed(&store, &msg(&format!("early-{i}")))))
        .collect();
    let late: Vec<i64> = (0..2)
        .map(|i| id_of(enqueue_committed(&store, &msg(&format!("late-{i}")))))
        .collect();
    let unpublished = id_of(enqueue_committed(&store, &msg("unpublished")));
    let lease = store
        .lease("relay-1", 5, Duration::from_secs(3 * 3600))
        .unwrap();
    assert_eq!(lease.rows.len(), 5);
    assert_eq!(store.mark_published("relay-1", &early).unwrap(), 3);
    clock.advance(secs(5400));
    assert_eq!(store.mark_published("relay-1", &late).unwrap(), 2);
    clock.advance(secs(1800));

    // Now is start + 2h: with a 1 h window the rows published at start are old.
    let retention = Retention::new(secs(3600), secs(3600), secs(600)).unwrap();
    let err = store.purge_published(&retention, 0).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::InvalidSetting { setting: "batch", expected: "at least 1 row", found }
                if found == "0"
        ),
        "{err:?}"
    );
    assert_eq!(
        store.purge_published(&retention, 2).unwrap(),
        3,
        "a full batch is followed by another"
    );
    assert_eq!(store.purge_published(&retention, 2).unwrap(), 0);
    let left: Vec<i64> = fx.connect().outbox().iter().map(|r| r.id).collect();
    let mut expected = late.clone();
    expected.push(unpublished);
    assert_eq!(left, expected);

    // An hour later the others are old too; the unpublished row stays.
    clock.advance(secs(3600));
    assert_eq!(store.purge_published(&retention, 1).unwrap(), 2);
    let left: Vec<i64> = fx.connect().outbox().iter().map(|r| r.id).collect();
    assert_eq!(left, [unpublished]);
}

fn retention_deletes_only_old_done_claims<F: Fixture>(fx: &F) {
    let clock = ManualClock::new(start_time());
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "fails" {
            Outcome::ApplyThenFail
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(fx.builder().clock(Arc::new(clock.clone())).handler(handler));
    let g = group(GROUP);
    let batch = [usage("old-1", 1), usage("old-2", 1), usage("old-3", 1)];
    store.process_batch(&g, &batch).unwrap();
    let failed = store.process_batch(&g, &[usage("fails", 1)]).unwrap();
    assert!(matches!(failed[0], Decision::RetryAfter(_)));
    clock.advance(secs(7200));
    store.process_batch(&g, &[usage("recent", 1)]).unwrap();
    clock.advance(secs(60));

    let err = Retention::new(secs(3600), secs(599), secs(600)).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::InvalidSetting { setting: "done_claims", found, .. }
                if found == "599s, with a longest retry delay of 600s"
        ),
        "{err:?}"
    );

    let retention = Retention::new(secs(3600), secs(3600), secs(600)).unwrap();
    assert_eq!(store.purge_done_claims(&retention, 2).unwrap(), 3);
    assert_eq!(store.purge_done_claims(&retention, 2).unwrap(), 0);
    let claim = |k: &str| {
        store
            .claim_record(&inbox_core::ClaimKey::new(
                g.clone(),
                MessageKey::new(k).unwrap(),
            ))
            .unwrap()
    };
    for k in ["old-1", "old-2", "old-3"] {
        assert_eq!(claim(k), None, "{k} deleted");
    }
    assert_eq!(claim("fails").unwrap().status, ClaimStatus::Failed);
    assert_eq!(claim("recent").unwrap().status, ClaimStatus::Done);
}

fn enqueue_refuses_what_could_never_be_published_or_read_back<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let mut conn = store.connection().unwrap();
    let long = "n".repeat(256);
    let with_header = |key: &str, name: &str, value: &str| {
        let mut m = msg(key);
        m.headers.insert(name.to_owned(), value.to_owned());
        m
    };
    let mut long_exchange = msg("e1");
    long_exchange.exchange = long.clone();
    let cases = [
        (
            long_exchange,
            "exchange must be at most 255 bytes, found 256",
        ),
        (
            msg("e2").with_routing_key(long.as_str()),
            "routing key must be at most 255",
        ),
        (
            msg("e3").with_routing_key("a\0b"),
            "routing key must not contain a NUL",
        ),
        (
            msg("e4").with_ordering_key(long.as_str()),
            "ordering key must be at most 255",
        ),
        (
            msg("e5").with_ordering_key("k\0"),
            "ordering key must not contain a NUL",
        ),
        (
            msg("e6").with_tenant("acme\0"),
            "tenant must not contain a NUL",
        ),
        (
            with_header("e7", "", "v"),
            "header name must be 1 to 255 bytes, found 0",
        ),
        (
            with_header("e8", &long, "v"),
            "header name must be 1 to 255 bytes, found 256",
        ),
        (with_header("e9", "trace", "a\0"), "must not contain a NUL"),
        (with_header("e10", "tr\0ce", "a"), "must not contain a NUL"),
        (
            {
                let mut m = msg("e11");
                m.message_type = long.clone();
                m
            },
            "message type must be at most 255",
        ),
        (
            {
                let mut m = msg("e12");
                m.payload = vec![b'x'; DEFAULT_MAX_OUTBOX_PAYLOAD + 1];
                m
            },
            "body must be at most 16777216 bytes, found 16777217 bytes",
        ),
    ];
    for (message, expected) in cases {
        match enqueue(&mut *conn, &message, clock.now()) {
            Err(Error::InvalidOutboxMessage { key, reason }) => {
                assert!(reason.contains(expected), "{reason}");
                assert_eq!(key, message.message_key.as_str());
            }
            other => panic!("{expected}: expected a refusal, found {other:?}"),
        }
    }
    // A configured limit, both ways.
    let limits = EnqueueLimits::default().max_payload(10);
    let mut small = msg("s1");
    small.payload = vec![b'x'; 10];
    id_of(enqueue_with(&mut *conn, &small, clock.now(), &limits).unwrap());
    small.message_key = MessageKey::new("s2").unwrap();
    small.payload.push(b'x');
    let refused = enqueue_with(&mut *conn, &small, clock.now(), &limits);
    assert!(
        matches!(&refused, Err(Error::InvalidOutboxMessage { reason, .. }) if reason.contains("at most 10 bytes, found 11")),
        "{refused:?}"
    );
    let stored = fx.connect().outbox();
    assert_eq!(stored.len(), 1, "only the row within its limit: {stored:?}");
    assert_eq!(stored[0].message_key, "s1");
}

/// Writes a value into a row behind the store's back, as another producer might.
fn corrupt<C: TestConn>(conn: &mut C, id: i64, assignment: &str) {
    conn.batch_execute(&format!(
        "UPDATE outbox_messages SET {assignment} WHERE id = {id}"
    ))
    .unwrap();
}

fn unreadable_rows_are_leased_apart_and_never_fail_the_lease<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let a = id_of(enqueue_committed(&store, &msg("a")));
    let bad_headers = id_of(enqueue_committed(&store, &msg("bad-headers")));
    let long_key = id_of(enqueue_committed(&store, &msg("long-key")));
    let b = id_of(enqueue_committed(&store, &msg("b")));
    let mut raw = fx.connect();
    corrupt(&mut raw, bad_headers, "headers = 'not json'");
    corrupt(
        &mut raw,
        long_key,
        &format!("message_key = '{}'", "k".repeat(300)),
    );
    // A timestamp diesel cannot decode fails the whole statement: the store reads
    // the lease's rows again row by row (on PostgreSQL, after the one statement that
    // leased and read them has committed).
    let bad_time = id_of(enqueue_committed(&store, &msg("bad-time")));
    let undecodable = match store.backend() {
        inbox_diesel::Backend::Sqlite => "created_at = 'yesterday'",
        _ => "created_at = 'infinity'",
    };
    corrupt(&mut raw, bad_time, undecodable);
    let expected_unreadable = vec![bad_headers, long_key, bad_time];

    let lease = store.lease("relay-1", 10, LEASE).unwrap();
    assert_eq!(ids(&lease), [a, b], "the readable rows go out");
    let unreadable: Vec<i64> = lease.unreadable.iter().map(|r| r.id).collect();
    assert_eq!(unreadable, expected_unreadable);
    assert!(
        lease.unreadable[0]
            .error
            .contains("headers are not a JSON object"),
        "{:?}",
        lease.unreadable[0]
    );
    assert!(
        lease.unreadable[1].error.contains("at most 255 bytes"),
        "{:?}",
        lease.unreadable[1]
    );
    assert!(lease.unreadable.iter().all(|r| r.attempts == 0));
    // Leased like the others: no other relay takes them meanwhile.
    let stored = fx.connect().outbox();
    assert!(stored
        .iter()
        .all(|r| r.leased_by.as_deref() == Some("relay-1")));

    // Their failure is recorded by id; then they die.
    let failures: Vec<_> = lease
        .unreadable
        .iter()
        .map(|r| retry(r.id, &r.error, secs(5)))
        .collect();
    store.record_failures("relay-1", &failures).unwrap();
    assert_eq!(store.mark_published("relay-1", &[a, b]).unwrap(), 2);
    clock.advance(secs(5));
    let again = store.lease("relay-2", 10, LEASE).unwrap();
    assert!(again.rows.is_empty());
    assert_eq!(
        again.unreadable.iter().map(|r| r.id).collect::<Vec<_>>(),
        expected_unreadable
    );
    assert!(again.unreadable.iter().all(|r| r.attempts == 1));
    let buried: Vec<_> = again
        .unreadable
        .iter()
        .map(|r| dead(r.id, &r.error))
        .collect();
    store.record_failures("relay-2", &buried).unwrap();
    let listed: Vec<i64> = store
        .dead_outbox_rows(10)
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(listed, expected_unreadable);
    clock.advance(secs(3600));
    let none = store.lease("relay-3", 10, LEASE).unwrap();
    assert!(none.rows.is_empty() && none.unreadable.is_empty());
}

fn a_row_that_fails_its_last_attempt_is_dead_listed_and_holds_up_nothing<F: Fixture>(fx: &F)
where
    F::Conn: Inspect,
{
    let clock = ManualClock::new(start_time());
    let store = store_on(fx, &clock);
    let k1 = id_of(enqueue_committed(
        &store,
        &msg("k-1").with_ordering_key("k"),
    ));
    let k2 = id_of(enqueue_committed(
        &store,
        &msg("k-2").with_ordering_key("k"),
    ));
    let free = id_of(enqueue_committed(&store, &msg("free")));
    assert_eq!(lease_at_least(&store, "relay-1", 2), [k1, free]);
    assert_eq!(store.mark_published("relay-1", &[free]).unwrap(), 1);

    clock.advance(secs(7));
    store
        .record_failures("relay-1", &[dead(k1, "NOT_FOUND - no exchange 'billing'")])
        .unwrap();
    let stored = fx.connect().outbox();
    assert_eq!(stored[0].attempts, 1);
    assert_eq!(
        (stored[0].leased_by.as_deref(), stored[0].published_at),
        (None, None)
    );

    let listed = store.dead_outbox_rows(10).unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let row = &listed[0];
    assert_eq!(
        (row.id, row.message_key.as_str(), row.attempts),
        (k1, "k-1", 1)
    );
    assert_eq!(row.ordering_key.as_deref(), Some("k"));
    assert_eq!(
        row.last_error.as_deref(),
        Some("NOT_FOUND - no exchange 'billing'")
    );
    assert_eq!(row.dead_at, at(secs(7)));
    assert!(store.dead_outbox_rows(0).unwrap().is_empty());

    // Dead holds up nothing: k-2 goes, and k-1 is never leased again.
    assert_eq!(lease_at_least(&store, "relay-2", 1), [k2]);
    assert_eq!(store.mark_published("relay-2", &[k2]).unwrap(), 1);
    clock.advance(secs(86_400));
    assert!(store.lease("relay-3", 10, LEASE).unwrap().rows.is_empty());
    assert_eq!(
        store.oldest_unpublished_age().unwrap(),
        None,
        "a dead row is no lag"
    );

    // An operator revives it: live again, due now, attempts from 0.
    assert_eq!(store.revive_outbox_rows(&[k1, k2, free]).unwrap(), 1);
    assert!(store.dead_outbox_rows(10).unwrap().is_empty());
    let revived = store.lease("relay-3", 10, LEASE).unwrap();
    assert_eq!(ids(&revived), [k1]);
    assert_eq!(revived.rows[0].attempts, 0);
}

mod postgres_only {
    use super::*;
    use inbox_test_support::PgFixture;

    #[derive(QueryableByName)]
    struct Int {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        n: i32,
    }

    #[derive(QueryableByName)]
    struct BigCount {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }

    fn backend_pid(conn: &mut PgConnection) -> i32 {
        diesel::sql_query("SELECT pg_backend_pid() AS n")
            .get_result::<Int>(conn)
            .unwrap()
            .n
    }

    /// Waits until backend `pid` waits for a lock (a condition read from `pg_locks`,
    /// not a timing); panics when `finished` says its statement ended without
    /// waiting, or after 30 s.
    fn wait_for_lock_wait(observer: &mut PgConnection, pid: i32, finished: &mpsc::Receiver<()>) {
        let give_up = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let waiting = diesel::sql_query(
                "SELECT count(*) AS n FROM pg_locks WHERE pid = $1 AND NOT granted",
            )
            .bind::<diesel::sql_types::Integer, _>(pid)
            .get_result::<BigCount>(observer)
            .unwrap()
            .n;
            if waiting > 0 {
                return;
            }
            assert!(
                finished.try_recv().is_err(),
                "backend {pid} finished without waiting for a lock"
            );
            assert!(
                std::time::Instant::now() < give_up,
                "backend {pid} never waited for a lock"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The ordering locks `pid` holds (granted).
    fn ordering_locks_held(observer: &mut PgConnection, pid: i32) -> i64 {
        diesel::sql_query(
            "SELECT count(*) AS n FROM pg_locks WHERE pid = $1 AND granted \
             AND locktype = 'advisory' AND classid = $2::int4::oid AND objsubid = 2",
        )
        .bind::<diesel::sql_types::Integer, _>(pid)
        .bind::<diesel::sql_types::Integer, _>(ORDERING_LOCK_CLASS)
        .get_result::<BigCount>(observer)
        .unwrap()
        .n
    }

    /// A key whose stripe satisfies `pred`, named `prefix-<n>`.
    fn key_where(prefix: &str, pred: impl Fn(i32) -> bool) -> String {
        (0..100_000)
            .map(|n| format!("{prefix}-{n}"))
            .find(|k| pred(ordering_lock_stripe(k)))
            .unwrap()
    }

    /// A publisher standing in for a round whose process dies before any confirm:
    /// nothing settled and nothing said (a round told its publication was lost
    /// releases the unanswered rows; a dead process says nothing), its rows stay
    /// leased.
    struct DiesMidRound;

    impl inbox_core::OutboxPublisher for DiesMidRound {
        fn publish(&mut self, _: &[inbox_core::OutboxRow], _: Duration) -> Publication {
            Publication::default()
        }
    }

    /// Publishes by confirming every row, after `meanwhile` ran (while the rows are
    /// "on the wire").
    struct ConfirmsAfter<F: FnMut()>(F);

    impl<F: FnMut()> inbox_core::OutboxPublisher for ConfirmsAfter<F> {
        fn publish(&mut self, rows: &[inbox_core::OutboxRow], _: Duration) -> Publication {
            (self.0)();
            let mut publication = Publication::default();
            for row in rows {
                publication.confirmed(row.id);
            }
            publication
        }
    }

    /// A failover that loses committed transactions rolls the outbox's rows back
    /// together with their id sequence, so an id comes round again for a new row. A
    /// round that published the lost row under that id and marks it after the
    /// failover must not mark the new row, which another round of the same relay
    /// holds and has not published: a round's lease is its own (`<relay>/<random
    /// token>` in `leased_by`), not the relay's. With the relay's name as the holder,
    /// the late mark marks the new row published, and it is never sent.
    #[test]
    fn a_late_mark_after_the_ids_rolled_back_leaves_the_new_row_under_that_id_alone() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = store_on(&fx, &clock);
        let lost = id_of(enqueue_committed(&store, &msg("lost")));
        let round = inbox_core::RelayRound::new("relay-1", 10).lease_for(LEASE);
        let mut new_row = None;
        let report = round
            .run(
                &store,
                &mut ConfirmsAfter(|| {
                    // The failover: the row and its id are gone on the new primary.
                    let mut conn = fx.connect();
                    diesel::sql_query("DELETE FROM outbox_messages WHERE id = $1")
                        .bind::<diesel::sql_types::BigInt, _>(lost)
                        .execute(&mut conn)
                        .unwrap();
                    diesel::sql_query(
                        "SELECT setval(pg_get_serial_sequence('outbox_messages', 'id'), $1, false)",
                    )
                    .bind::<diesel::sql_types::BigInt, _>(lost)
                    .execute(&mut conn)
                    .unwrap();
                    let id = id_of(enqueue_committed(&store, &msg("new")));
                    assert_eq!(id, lost, "the id came round again");
                    // Another round of the same relay leases the new row, then dies.
                    let other = round.run(&store, &mut DiesMidRound).unwrap();
                    assert_eq!(other.leased, 1);
                    new_row = Some(id);
                }),
            )
            .unwrap();
        assert_eq!(new_row, Some(lost));
        assert_eq!((report.confirmed, report.marked), (1, 0), "{report:?}");
        let stored = fx.connect().outbox();
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].published_at, None, "the new row is not published");
        let holder = stored[0].leased_by.clone().unwrap();
        let token = holder.strip_prefix("relay-1/").unwrap();
        assert_eq!(token.len(), 32, "{holder}");
        assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{holder}");

        // Once the dead round's lease expires, the new row goes out.
        clock.advance(LEASE);
        let published = round.run(&store, &mut ConfirmsAfter(|| {})).unwrap();
        assert_eq!((published.leased, published.marked), (1, 1));
    }

    #[test]
    fn concurrent_relays_lease_disjoint_rows() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = fx
            .builder()
            .clock(Arc::new(clock.clone()))
            .pool_size(4)
            .build()
            .unwrap();
        for round in 0..5 {
            let enqueued: BTreeSet<i64> = (0..20)
                .map(|i| id_of(enqueue_committed(&store, &msg(&format!("r{round}-{i}")))))
                .collect();
            let barrier = Arc::new(Barrier::new(2));
            let leases: Vec<_> = ["relay-a", "relay-b"]
                .into_iter()
                .map(|relay| {
                    let store = store.clone();
                    let barrier = Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        barrier.wait();
                        store.lease(relay, 10, LEASE).unwrap()
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|t| t.join().unwrap())
                .collect();
            let a: BTreeSet<i64> = ids(&leases[0]).into_iter().collect();
            let b: BTreeSet<i64> = ids(&leases[1]).into_iter().collect();
            assert!(a.is_disjoint(&b), "round {round}: {a:?} and {b:?} overlap");
            assert_eq!(a.len() + b.len(), 20, "round {round}: no row left behind");
            assert_eq!(a.union(&b).copied().collect::<BTreeSet<_>>(), enqueued);
            for row in fx.connect().outbox() {
                if a.contains(&row.id) {
                    assert_eq!(row.leased_by.as_deref(), Some("relay-a"));
                } else if b.contains(&row.id) {
                    assert_eq!(row.leased_by.as_deref(), Some("relay-b"));
                }
            }
            let all: Vec<i64> = enqueued.iter().copied().collect();
            let marked = store.mark_published("relay-a", &all).unwrap()
                + store.mark_published("relay-b", &all).unwrap();
            assert_eq!(marked, 20);
        }
    }

    #[test]
    fn lease_skips_rows_locked_by_another_transaction() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = store_on(&fx, &clock);
        let a = id_of(enqueue_committed(&store, &msg("a")));
        let b = id_of(enqueue_committed(&store, &msg("b")));

        // Another relay's lease transaction, caught between its lock and its commit.
        let mut holder = fx.connect();
        diesel::sql_query("BEGIN").execute(&mut holder).unwrap();
        diesel::sql_query("SELECT id FROM outbox_messages WHERE id = $1 FOR UPDATE")
            .bind::<diesel::sql_types::BigInt, _>(a)
            .execute(&mut holder)
            .unwrap();

        let (tx, rx) = mpsc::channel();
        let leaser = {
            let store = store.clone();
            std::thread::spawn(move || {
                let lease = store.lease("relay-b", 10, LEASE).unwrap();
                let _ = tx.send(());
                lease
            })
        };
        // Without SKIP LOCKED the lease waits for the holder, which only lets go
        // after this wait; it then takes `a` too and the assertion below fails.
        let _ = rx.recv_timeout(Duration::from_secs(10));
        diesel::sql_query("ROLLBACK").execute(&mut holder).unwrap();
        let lease = leaser.join().unwrap();
        assert_eq!(
            ids(&lease),
            [b],
            "the locked row is skipped, not waited for"
        );
    }

    /// T1 enqueues A (key K) first and stays open; T2's enqueue of B (key K) waits
    /// on K's ordering lock until T1 commits, so B's id is drawn after T1's commit;
    /// T1 enqueues A2 meanwhile: commit order is A, A2, B, and so is id order.
    /// Without the lock T2 commits B first with an id between A's and A2's; with the
    /// lock taken after the INSERT, B's id is drawn before A2's though B commits
    /// after it: either way id order would not be commit order.
    #[test]
    fn an_enqueue_of_a_key_waits_for_the_open_transaction_that_enqueued_it_first() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = store_on(&fx, &clock);
        let mut t1 = fx.connect();
        diesel::sql_query("BEGIN").execute(&mut t1).unwrap();
        let a = id_of(enqueue(&mut t1, &msg("a").with_ordering_key("K"), clock.now()).unwrap());
        let free = id_of(enqueue_committed(&store, &msg("free")));

        let mut t2 = fx.connect();
        let t2_pid = backend_pid(&mut t2);
        let (done, finished) = mpsc::channel();
        let writer = {
            let now = clock.now();
            std::thread::spawn(move || {
                let b = t2
                    .transaction(|t2| {
                        let b = id_of(enqueue(t2, &msg("b").with_ordering_key("K"), now)?);
                        Ok::<_, inbox_diesel::Error>(b)
                    })
                    .unwrap();
                let _ = done.send(());
                b
            })
        };
        let mut observer = fx.connect();
        wait_for_lock_wait(&mut observer, t2_pid, &finished);

        // B waits for T1 (it is not even written); the unordered row does not.
        let early = store.lease("relay-1", 10, LEASE).unwrap();
        assert_eq!(
            ids(&early),
            [free],
            "B must not go out while A's transaction is open"
        );
        for _ in 0..5 {
            assert!(store.lease("relay-1", 10, LEASE).unwrap().rows.is_empty());
        }

        // T1 enqueues again while T2 waits: A2 commits with A, before B.
        let a2 = id_of(enqueue(&mut t1, &msg("a2").with_ordering_key("K"), clock.now()).unwrap());
        diesel::sql_query("COMMIT").execute(&mut t1).unwrap();
        let b = writer.join().unwrap();
        assert!(a < a2 && a2 < b, "B's id is drawn after A's commit");
        assert_eq!(
            lease_at_least(&store, "relay-1", 1),
            [a],
            "A first, once committed"
        );
        assert!(
            store.lease("relay-2", 10, LEASE).unwrap().rows.is_empty(),
            "B waits for A"
        );
        assert_eq!(store.mark_published("relay-1", &[a]).unwrap(), 1);
        assert_eq!(lease_at_least(&store, "relay-2", 1), [a2], "then A2");
        assert_eq!(store.mark_published("relay-2", &[a2]).unwrap(), 1);
        assert_eq!(lease_at_least(&store, "relay-2", 1), [b], "then B");
    }

    /// Issue 21, item 4: T1 writes something first (its transaction id is older),
    /// T2 enqueues B (key K) and commits, then T1 enqueues A (key K) and commits.
    /// Commit order is B, A: B goes out first, though T1's transaction id is the
    /// lower one (a lease in (transaction id, id) order sent A first).
    #[test]
    fn a_transaction_that_wrote_first_but_enqueued_later_goes_out_later() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = fx.open(fx.builder().clock(Arc::new(clock.clone())));
        let mut t1 = fx.connect();
        diesel::sql_query("BEGIN").execute(&mut t1).unwrap();
        t1.record_effect("t1-business-write", 1).unwrap();

        let mut t2 = fx.connect();
        let b = t2
            .transaction(|t2| {
                t2.record_effect("t2-business-write", 1)?;
                let b = id_of(enqueue(t2, &msg("b").with_ordering_key("K"), clock.now())?);
                Ok::<_, inbox_diesel::Error>(b)
            })
            .unwrap();

        let a = id_of(enqueue(&mut t1, &msg("a").with_ordering_key("K"), clock.now()).unwrap());
        diesel::sql_query("COMMIT").execute(&mut t1).unwrap();
        assert!(b < a);

        assert_eq!(
            lease_at_least(&store, "relay-1", 1),
            [b],
            "B committed first, so it goes out first"
        );
        assert!(
            store.lease("relay-2", 10, LEASE).unwrap().rows.is_empty(),
            "A waits for B"
        );
        assert_eq!(store.mark_published("relay-1", &[b]).unwrap(), 1);
        assert_eq!(lease_at_least(&store, "relay-2", 1), [a], "then A");
    }

    /// T1 enqueues [A, C, B] in one call, T2 [B, A]: opposite orders. H holds C's
    /// lock, so T1 stops at C; T2 starts while T1 waits; then H commits. Taken in
    /// call order, T1 would hold A and wait for C while T2 held B and waited for A,
    /// and once H let go T1 would wait for B: a deadlock, one of them aborted
    /// (40P01). Taken in stripe order (A < B < C), T1 holds A and B before it waits
    /// for C, T2 waits for A, and both commit.
    #[test]
    fn opposite_key_orders_in_one_call_never_deadlock() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = store_on(&fx, &clock);
        let stripes = ORDERING_LOCK_STRIPES as i32;
        let key_a = key_where("a", |s| s == 1);
        let key_b = key_where("b", |s| s == stripes / 2);
        let key_c = key_where("c", |s| s == stripes - 1);
        let now = clock.now();

        let mut holder = fx.connect();
        diesel::sql_query("BEGIN").execute(&mut holder).unwrap();
        let c0 = id_of(enqueue(&mut holder, &msg("c0").with_ordering_key(&key_c), now).unwrap());

        let mut observer = fx.connect();
        let spawn = |name: &'static str, batch: Vec<OutboxMessage>| {
            let mut conn = fx.connect();
            let pid = backend_pid(&mut conn);
            let (done, finished) = mpsc::channel();
            let writer = std::thread::spawn(move || {
                let outcome = conn.transaction(|conn| enqueue_all(conn, &batch, now));
                let _ = done.send(());
                outcome.map_err(|err| format!("{name}: {err:?}"))
            });
            (pid, finished, writer)
        };
        let (t1_pid, t1_finished, t1) = spawn(
            "T1",
            vec![
                msg("a1").with_ordering_key(&key_a),
                msg("c1").with_ordering_key(&key_c),
                msg("b1").with_ordering_key(&key_b),
            ],
        );
        wait_for_lock_wait(&mut observer, t1_pid, &t1_finished);
        let (t2_pid, t2_finished, t2) = spawn(
            "T2",
            vec![
                msg("b2").with_ordering_key(&key_b),
                msg("a2").with_ordering_key(&key_a),
            ],
        );
        wait_for_lock_wait(&mut observer, t2_pid, &t2_finished);
        diesel::sql_query("COMMIT").execute(&mut holder).unwrap();

        let t1 = t1.join().unwrap().expect("T1 commits");
        let t2 = t2.join().unwrap().expect("T2 commits");
        let [a1, c1, b1] = [0, 1, 2].map(|i| id_of(t1[i]));
        let [b2, a2] = [0, 1].map(|i| id_of(t2[i]));
        assert!(c0 < c1 && a1 < a2 && b1 < b2, "T1 committed before T2");

        // Each key's rows go out in commit order: H's, then T1's, then T2's.
        let first = lease_at_least(&store, "relay-1", 3);
        assert_eq!(first, [c0, a1, b1]);
        assert_eq!(store.mark_published("relay-1", &first).unwrap(), 3);
        let second = lease_at_least(&store, "relay-1", 3);
        assert_eq!(second, [c1, b2, a2]);
    }

    /// A bulk enqueue of 1,000 distinct keys, in one call and in 1,000 calls of one
    /// transaction, holds at most `ORDERING_LOCK_STRIPES` ordering locks (one lock per
    /// key would hold 1,000, past `max_locks_per_transaction`, and a few such
    /// transactions at once would fill the server's shared lock table), and every
    /// key's row goes out.
    #[test]
    fn a_bulk_enqueue_of_many_keys_holds_a_bounded_number_of_locks() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = store_on(&fx, &clock);
        let mut observer = fx.connect();
        let per_transaction: i64 = {
            #[derive(QueryableByName)]
            struct Setting {
                #[diesel(sql_type = diesel::sql_types::Text)]
                max_locks_per_transaction: String,
            }
            diesel::sql_query("SHOW max_locks_per_transaction")
                .get_result::<Setting>(&mut observer)
                .unwrap()
                .max_locks_per_transaction
                .parse()
                .unwrap()
        };
        let keys = 1_000;
        let stripes: BTreeSet<i32> = (0..keys)
            .map(|k| ordering_lock_stripe(&format!("key-{k}")))
            .collect();

        for (round, one_call) in [(0, true), (1, false)] {
            let mut conn = fx.connect();
            let pid = backend_pid(&mut conn);
            let batch: Vec<OutboxMessage> = (0..keys)
                .map(|k| msg(&format!("r{round}-{k}")).with_ordering_key(format!("key-{k}")))
                .collect();
            diesel::sql_query("BEGIN").execute(&mut conn).unwrap();
            if one_call {
                let outcomes = enqueue_all(&mut conn, &batch, clock.now()).unwrap();
                assert_eq!(outcomes.len(), keys);
            } else {
                for m in &batch {
                    id_of(enqueue(&mut conn, m, clock.now()).unwrap());
                }
            }
            let held = ordering_locks_held(&mut observer, pid);
            assert_eq!(
                held,
                stripes.len() as i64,
                "round {round}: one lock per stripe, not per key"
            );
            assert!(held <= per_transaction, "round {round}: {held} locks");
            diesel::sql_query("COMMIT").execute(&mut conn).unwrap();
            assert_eq!(
                ordering_locks_held(&mut observer, pid),
                0,
                "released at commit"
            );

            // Every key is a head of its own: the whole batch goes out at once.
            let leased = store.lease("relay-1", keys * 2, LEASE).unwrap();
            assert_eq!(leased.rows.len(), keys, "round {round}");
            assert_eq!(
                store.mark_published("relay-1", &ids(&leased)).unwrap(),
                keys
            );
        }
        assert_eq!(
            stripes.len(),
            ORDERING_LOCK_STRIPES as usize,
            "every stripe used"
        );
    }

    /// Two keys of one stripe: an enqueue of K2 waits for the open transaction that
    /// enqueued K1 (the price of the bound), a call with both keys takes their one
    /// lock once, and at the lease the keys stay apart: neither holds the other up,
    /// each goes out in its own commit order.
    #[test]
    fn keys_that_share_a_stripe_wait_at_enqueue_but_go_out_apart() {
        let Some(fx) = PgFixture::new() else { return };
        let clock = ManualClock::new(start_time());
        let store = store_on(&fx, &clock);
        let k1 = key_where("k1", |_| true);
        let k2 = key_where("k2", |s| s == ordering_lock_stripe(&k1));
        let now = clock.now();

        let mut t1 = fx.connect();
        let t1_pid = backend_pid(&mut t1);
        diesel::sql_query("BEGIN").execute(&mut t1).unwrap();
        let x1 = id_of(enqueue(&mut t1, &msg("x1").with_ordering_key(&k1), now).unwrap());

        let mut t2 = fx.connect();
        let t2_pid = backend_pid(&mut t2);
        let (done, finished) = mpsc::channel();
        let k2_in_t2 = k2.clone();
        let writer = std::thread::spawn(move || {
            let y1 = t2
                .transaction(|t2| enqueue(t2, &msg("y1").with_ordering_key(k2_in_t2), now))
                .unwrap();
            let _ = done.send(());
            id_of(y1)
        });
        let mut observer = fx.connect();
        wait_for_lock_wait(&mut observer, t2_pid, &finished);
        let x2 = id_of(enqueue(&mut t1, &msg("x2").with_ordering_key(&k1), now).unwrap());
        assert_eq!(ordering_locks_held(&mut observer, t1_pid), 1);
        diesel::sql_query("COMMIT").execute(&mut t1).unwrap();
        let y1 = writer.join().unwrap();
        assert!(x2 < y1);

        // One call with both keys of the stripe: one lock, taken once.
        let both = store
            .connection()
            .unwrap()
            .transaction(|conn| {
                enqueue_all(
                    conn,
                    &[
                        msg("y2").with_ordering_key(&k2),
                        msg("x3").with_ordering_key(&k1),
                    ],
                    now,
                )
            })
            .unwrap();
        let (y2, x3) = (id_of(both[0]), id_of(both[1]));

        // The heads of both keys at once; then each key's next.
        let mut published = Vec::new();
        for expected in [vec![x1, y1], vec![x2, y2], vec![x3]] {
            let leased = lease_at_least(&store, "relay-1", expected.len());
            assert_eq!(leased, expected);
            assert!(store.lease("relay-2", 10, LEASE).unwrap().rows.is_empty());
            store.mark_published("relay-1", &leased).unwrap();
            published.extend(leased);
        }
        assert_eq!(published.len(), 5);
    }

    /// The LISTEN connection killed while a relay waits on it: the wait fails at
    /// once with the error (diesel's notification iterator repeats a broken
    /// connection's error without end, and collecting it filled the memory), and the
    /// next wait listens on a new connection and is woken by a commit.
    #[test]
    fn a_killed_listen_connection_fails_the_wait_and_the_next_wait_listens_again() {
        let Some(fx) = PgFixture::new() else { return };
        let name = inbox_test_support::unique_name("listener");
        let sep = if fx.url().contains('?') { '&' } else { '?' };
        let store =
            Store::<PgConnection>::builder(format!("{}{sep}application_name={name}", fx.url()))
                .schema(fx.schema.clone())
                .pool_size(1)
                .build()
                .unwrap();
        assert!(store.wait_for_enqueue(Duration::from_secs(10)).unwrap());
        let killed = diesel::sql_query(
            "SELECT count(pg_terminate_backend(pid))::int AS n FROM pg_stat_activity \
             WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind::<diesel::sql_types::Text, _>(&name)
        .get_result::<Int>(&mut fx.connect())
        .unwrap()
        .n;
        assert_eq!(killed, 1, "the store's LISTEN connection");
        let (tx, rx) = mpsc::channel();
        {
            let store = store.clone();
            std::thread::spawn(move || {
                let _ = tx.send(store.wait_for_enqueue(Duration::from_secs(5)));
            });
        }
        let failed = rx
            .recv_timeout(Duration::from_secs(8))
            .expect("the wait on a killed connection came back");
        assert!(failed.is_err(), "{failed:?}");
        // Listening again: a fresh connection reports a possible missed enqueue, then
        // a commit wakes it.
        assert!(store.wait_for_enqueue(Duration::from_secs(10)).unwrap());
        let waiter = {
            let store = store.clone();
            std::thread::spawn(move || store.wait_for_enqueue(Duration::from_secs(30)).unwrap())
        };
        id_of(enqueue_committed(&store, &msg("after")));
        assert!(waiter.join().unwrap(), "woken by the commit");
    }

    #[test]
    fn wait_for_enqueue_wakes_on_commit_only() {
        let Some(fx) = PgFixture::new() else { return };
        let store = fx.builder().pool_size(1).build().unwrap();
        // A fresh LISTEN connection may have missed an enqueue: it says so.
        assert!(store.wait_for_enqueue(Duration::from_secs(10)).unwrap());
        assert!(
            !store.wait_for_enqueue(Duration::from_millis(200)).unwrap(),
            "nothing enqueued since"
        );

        // Committed on another connection: woken. The waiter holds no pool
        // connection, so the enqueue can use the pool's only one.
        let waiter = {
            let store = store.clone();
            std::thread::spawn(move || store.wait_for_enqueue(Duration::from_secs(30)).unwrap())
        };
        id_of(enqueue_committed(&store, &msg("committed")));
        assert!(waiter.join().unwrap(), "woken by the commit");

        // A key enqueued already writes nothing and wakes nobody.
        assert_eq!(
            enqueue_committed(&store, &msg("committed")),
            EnqueueOutcome::AlreadyEnqueued
        );
        assert!(!store.wait_for_enqueue(Duration::from_millis(300)).unwrap());

        // Rolled back: nobody is woken.
        enqueue_rolled_back(&store, &msg("rolled-back"));
        assert!(!store.wait_for_enqueue(Duration::from_millis(300)).unwrap());

        // Committed in another schema of the same database: not ours.
        let other = PgFixture::new().unwrap();
        let other_store = other.builder().build().unwrap();
        id_of(enqueue_committed(&other_store, &msg("elsewhere")));
        assert!(!store.wait_for_enqueue(Duration::from_millis(300)).unwrap());

        // A connection outside the pool, with the schema on its search path.
        let mut conn = fx.connect();
        conn.transaction(|conn| enqueue(conn, &msg("own"), Utc::now()))
            .unwrap();
        assert!(store.wait_for_enqueue(Duration::from_secs(30)).unwrap());
    }
}

mod sqlite_only {
    use super::*;
    use inbox_test_support::SqliteFixture;

    #[test]
    fn relays_to_the_in_process_transport_exactly_once() {
        let fx = SqliteFixture::new();
        let clock = ManualClock::new(start_time());
        let handler = Recorder::new(GROUP);
        let calls = handler.calls();
        let store = fx.open(fx.builder().clock(Arc::new(clock.clone())).handler(handler));

        // The business write and the enqueue commit together, or not at all.
        let mut pooled = store.connection().unwrap();
        let conn: &mut diesel::SqliteConnection = &mut pooled;
        conn.transaction(|conn| {
            conn.record_effect("order-1", 0)?;
            enqueue(conn, &msg("m1"), clock.now())
        })
        .unwrap();
        drop(pooled);
        enqueue_rolled_back(&store, &msg("m2"));

        let mut transport =
            InProcessTransport::new(store.clone()).with_clock(Arc::new(clock.clone()));
        assert_eq!(
            relay_in_process(&store, &mut transport, "relay-1", 10).unwrap(),
            1
        );
        let stats = transport.run_until_idle().unwrap();
        assert_eq!(stats.processed, 1);

        // Again: nothing left to relay, nothing processed twice.
        clock.advance(LEASE * 2);
        assert_eq!(
            relay_in_process(&store, &mut transport, "relay-1", 10).unwrap(),
            0
        );
        transport.run_until_idle().unwrap();
        assert_eq!(fx.connect().effects_of("m1").unwrap(), 1);
        assert_eq!(fx.connect().effects_of("m2").unwrap(), 0);
        assert_eq!(calls.lock().unwrap().as_slice(), ["m1"]);
        let stored = fx.connect().outbox();
        assert_eq!(stored.len(), 1, "the rolled-back enqueue left no row");
        assert_eq!(stored[0].published_at, Some(start_time()));
        assert_eq!(store.oldest_unpublished_age().unwrap(), None);
    }

    /// SQLite has one writer: T1's first write takes the database's write lock until
    /// T1 commits, so T2 cannot enqueue in between (its INSERT waits out the busy
    /// timeout's retries) and the race PostgreSQL's ordering lock prevents cannot
    /// happen: T2's id comes after T1's commit, and id order is commit order.
    #[test]
    fn one_writer_so_an_enqueue_after_another_transactions_first_write_comes_later() {
        let fx = SqliteFixture::new();
        let clock = ManualClock::new(start_time());
        let store = fx.open(fx.builder().clock(Arc::new(clock.clone())));
        let now = clock.now();
        let mut t1 = fx.connect();
        diesel::sql_query("BEGIN IMMEDIATE")
            .execute(&mut t1)
            .unwrap();
        t1.record_effect("t1-business-write", 1).unwrap();

        let (started, t2_started) = mpsc::channel();
        let writer = {
            let mut t2 = fx.connect();
            std::thread::spawn(move || {
                let _ = started.send(());
                t2.immediate_transaction(|t2| {
                    t2.record_effect("t2-business-write", 1)?;
                    enqueue(t2, &msg("b").with_ordering_key("K"), now)
                })
                .unwrap()
            })
        };
        t2_started.recv().unwrap();
        let a = id_of(enqueue(&mut t1, &msg("a").with_ordering_key("K"), now).unwrap());
        diesel::sql_query("COMMIT").execute(&mut t1).unwrap();
        let b = id_of(writer.join().unwrap());
        assert!(a < b, "T2's enqueue came after T1's commit");

        assert_eq!(ids(&store.lease("relay-1", 10, LEASE).unwrap()), [a]);
        assert_eq!(store.mark_published("relay-1", &[a]).unwrap(), 1);
        assert_eq!(ids(&store.lease("relay-1", 10, LEASE).unwrap()), [b]);
    }

    #[test]
    fn wait_for_enqueue_sleeps_on_the_store_clock() {
        let fx = SqliteFixture::new();
        let clock = ManualClock::new(start_time());
        let store = store_on(&fx, &clock);
        assert!(!store.wait_for_enqueue(secs(5)).unwrap());
        assert_eq!(clock.now(), at(secs(5)), "a manual clock advances instead");
    }
}
