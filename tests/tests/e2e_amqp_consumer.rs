//! The consumer runtime against real RabbitMQ and PostgreSQL: each test has its own
//! schema, its own exchange and queue names (a prefix), and cleans its queues up.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDate;
use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, StatsSnapshot, Topology};
use inbox_core::{
    ConsumerGroup, DeadLetterReason, Handler, HandlerError, MessageContext, RetryPolicy,
};
use inbox_diesel::{ClaimStatus, Store, StoreBuilder};
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, Workload, GROUP, MESSAGE_TYPE};
use inbox_test_support::amqp::{
    self, amqp_url, confirm_channel, eventually, publish, queue_depth, wait_for_confirms, Outgoing,
};
use inbox_test_support::ms;
use inbox_test_support::{unique_name, Fixture, PgFixture};

/// One test's database schema, broker names and consumer pieces.
struct Setup {
    db: PgFixture,
    url: String,
    topology: Topology,
    group: ConsumerGroup,
}

impl Setup {
    fn new() -> Option<Self> {
        let url = amqp_url()?;
        let db = PgFixture::new()?;
        let topology = amqp::test_topology(&amqp::unique_prefix("t"), &[50, 100, 200]);
        Some(Self {
            db,
            url,
            topology,
            group: ConsumerGroup::new(GROUP).unwrap(),
        })
    }

    fn store_builder(&self) -> StoreBuilder<PgConnection> {
        self.db
            .builder()
            .pool_size(6)
            .retry_ladder(self.topology.retry_ladder().clone())
    }

    fn store(&self, handler: DailyUsage) -> Arc<Store<PgConnection>> {
        let store = self
            .store_builder()
            .handler(handler)
            .build()
            .expect("store");
        store.connection().unwrap().create_daily_usage().unwrap();
        Arc::new(store)
    }

    fn consumer(&self, store: Arc<Store<PgConnection>>) -> Consumer<Store<PgConnection>> {
        Consumer::new(self.url.clone(), store, self.topology.clone()).with_settings(
            ConsumerSettings::default()
                .workers(2)
                .prefetch(100)
                .batch(50, ms(5))
                .max_body_bytes(4096),
        )
    }

    fn queues(&self) -> Vec<String> {
        self.topology
            .clone()
            .group(self.group.clone(), [MESSAGE_TYPE])
            .queues()
    }

    async fn cleanup(&self) {
        let conn = amqp::connect(&self.url).await;
        let topology = self
            .topology
            .clone()
            .group(self.group.clone(), [MESSAGE_TYPE]);
        topology.delete(&conn).await.expect("delete topology");
        let _ = conn.close(200, "done".into()).await;
    }
}

fn body(event: &UsageRecorded) -> Vec<u8> {
    serde_json::to_vec(event).unwrap()
}

/// Publishes every event of the workload once, and `duplicates` of them again.
async fn publish_workload(setup: &Setup, workload: &Workload, duplicates: usize) {
    let conn = amqp::connect(&setup.url).await;
    let channel = confirm_channel(&conn).await;
    let exchange = setup.topology.exchange();
    let order = (0..workload.events.len()).chain(0..duplicates);
    for i in order {
        let (key, event) = &workload.events[i];
        let body = body(event);
        publish(
            &channel,
            &exchange,
            &Outgoing {
                message_id: Some(key.as_str()),
                message_type: MESSAGE_TYPE,
                body: &body,
                tenant: Some("acme"),
            },
        )
        .await;
    }
    wait_for_confirms(&channel).await;
    let _ = conn.close(200, "done".into()).await;
}

fn totals(store: &Store<PgConnection>) -> BTreeMap<(i64, NaiveDate), i64> {
    store.connection().unwrap().daily_totals().unwrap()
}

async fn run_until(
    consumer: Consumer<Store<PgConnection>>,
    limit: Duration,
    done: impl Fn(&StatsSnapshot) -> bool,
) -> StatsSnapshot {
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let finished = eventually(limit, || done(&stats.snapshot())).await;
    shutdown.cancel();
    running.await.unwrap().expect("consumer ends cleanly");
    let snapshot = stats.snapshot();
    assert!(
        finished,
        "the consumer did not finish in time: {snapshot:?}"
    );
    snapshot
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_events_with_ten_percent_duplicates() {
    let Some(setup) = Setup::new() else { return };
    let store = setup.store(DailyUsage::new(RetryPolicy::default()));
    let consumer = setup.consumer(Arc::clone(&store));
    consumer
        .topology()
        .declare(&amqp::connect(&setup.url).await)
        .await
        .unwrap();
    let workload = Workload::generate(5_000, 0, 42);
    publish_workload(&setup, &workload, 500).await;

    let stats = run_until(consumer, Duration::from_secs(120), |s| {
        s.processed + s.duplicates >= 5_500
    })
    .await;
    assert_eq!(stats.processed, 5_000, "{stats:?}");
    assert_eq!(stats.duplicates, 500, "{stats:?}");
    assert_eq!(
        stats.dead_lettered + stats.retried + stats.malformed,
        0,
        "{stats:?}"
    );
    assert_eq!(totals(&store), workload.expected_totals());
    let conn = amqp::connect(&setup.url).await;
    assert_eq!(
        queue_depth(&conn, &setup.topology.queue(&setup.group)).await,
        0
    );
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_message_climbs_the_retry_ladder_then_dead_letters_once() {
    let Some(setup) = Setup::new() else { return };
    let policy = RetryPolicy::new(4, ms(50), ms(200)).unwrap();
    let store = setup.store(DailyUsage::new(policy));
    // Every change of the poison claim, kept by a trigger of this test's schema.
    setup.db.execute(
        "CREATE TABLE claim_history (attempts INT, status TEXT, next_attempt_at TIMESTAMPTZ, updated_at TIMESTAMPTZ);
         CREATE FUNCTION keep_history() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO claim_history VALUES (NEW.attempts, NEW.status, NEW.next_attempt_at, NEW.updated_at); RETURN NEW; END $$;
         CREATE TRIGGER keep_history AFTER UPDATE ON inbox_claims FOR EACH ROW EXECUTE FUNCTION keep_history();",
    );
    let consumer = setup.consumer(Arc::clone(&store));
    consumer
        .topology()
        .declare(&amqp::connect(&setup.url).await)
        .await
        .unwrap();
    // User 0 does not exist: its event always fails. 50 others succeed.
    let workload = Workload::generate(51, 1, 5);
    publish_workload(&setup, &workload, 0).await;

    let stats = run_until(consumer, Duration::from_secs(60), |s| {
        s.processed >= 50 && s.dead_lettered >= 1
    })
    .await;
    assert_eq!(stats.processed, 50);
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(stats.retried, 3);
    // Through growing tiers: one retry each to 50, 100 and 200 ms.
    assert_eq!(
        stats.retries_per_tier,
        BTreeMap::from([(ms(50), 1), (ms(100), 1), (ms(200), 1)])
    );
    // The stored not-before times record the delay each retry really waited.
    #[derive(diesel::QueryableByName)]
    struct Step {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        attempts: i32,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        delay_ms: i64,
    }
    let steps: Vec<Step> = {
        use diesel::RunQueryDsl;
        diesel::sql_query(
            "SELECT attempts, (EXTRACT(EPOCH FROM next_attempt_at - updated_at) * 1000)::bigint AS delay_ms
             FROM claim_history WHERE status = 'failed' ORDER BY attempts",
        )
        .load(&mut setup.db.connect())
        .unwrap()
    };
    let steps: Vec<(i32, i64)> = steps
        .into_iter()
        .map(|s| (s.attempts, s.delay_ms))
        .collect();
    assert_eq!(steps, [(1, 50), (2, 100), (3, 200)]);

    let key = &workload.events[0].0;
    let claim = store
        .claim_record(&inbox_core::ClaimKey::new(setup.group.clone(), key.clone()))
        .unwrap()
        .unwrap();
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Dead, 4));
    let dead = store.dead_letters(&setup.group).unwrap();
    assert_eq!(dead.len(), 1, "dead-lettered exactly once");
    assert_eq!(dead[0].reason, inbox_core::DeadLetterReason::MaxAttempts);
    assert_eq!(dead[0].tenant.as_deref(), Some("acme"));
    assert_eq!(totals(&store), workload.expected_totals());
    let conn = amqp::connect(&setup.url).await;
    for queue in setup.queues() {
        assert_eq!(queue_depth(&conn, &queue).await, 0, "{queue} drained");
    }
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_deliveries_are_dead_lettered_and_consuming_goes_on() {
    let Some(setup) = Setup::new() else { return };
    let store = setup.store(DailyUsage::new(RetryPolicy::default()));
    let consumer = setup.consumer(Arc::clone(&store));
    let conn = amqp::connect(&setup.url).await;
    consumer.topology().declare(&conn).await.unwrap();
    let channel = confirm_channel(&conn).await;
    let exchange = setup.topology.exchange();
    let good = body(&UsageRecorded {
        user_id: 7,
        day: NaiveDate::from_ymd_opt(2026, 11, 30).unwrap(),
        amount: 40,
    });
    let huge = vec![b' '; 10_000];
    let cases: [(Option<&str>, &str, &[u8]); 5] = [
        (None, MESSAGE_TYPE, &good),                        // no message_id
        (Some("bad-body"), MESSAGE_TYPE, b"{\"user_id\":"), // does not decode
        (Some("too-big"), MESSAGE_TYPE, &huge),             // over max_body_bytes
        (
            Some("negative"),
            MESSAGE_TYPE,
            b"{\"user_id\":1,\"day\":\"2026-11-30\",\"amount\":-5}",
        ),
        (Some("good"), MESSAGE_TYPE, &good),
    ];
    for (id, ty, body) in cases {
        publish(
            &channel,
            &exchange,
            &Outgoing {
                message_id: id,
                message_type: ty,
                body,
                tenant: None,
            },
        )
        .await;
    }
    // A type no handler takes, routed straight to the group's queue.
    channel
        .basic_publish(
            "".into(),
            setup.topology.queue(&setup.group).as_str().into(),
            lapin::options::BasicPublishOptions::default(),
            &good,
            lapin::BasicProperties::default()
                .with_message_id("unknown-type".into())
                .with_type("usage.unknown".into()),
        )
        .await
        .unwrap();
    wait_for_confirms(&channel).await;

    let stats = run_until(consumer, Duration::from_secs(30), |s| {
        s.processed >= 1 && s.received >= 6
    })
    .await;
    let dead = store.dead_letters(&setup.group).unwrap();
    let reasons: BTreeMap<String, DeadLetterReason> = dead
        .iter()
        .map(|d| (d.last_error.clone().unwrap_or_default(), d.reason))
        .collect();
    let reason_of = |needle: &str| {
        reasons
            .iter()
            .find(|(err, _)| err.contains(needle))
            .map(|(_, r)| *r)
            .unwrap_or_else(|| panic!("no dead letter mentions {needle:?}: {reasons:?}"))
    };
    assert_eq!(reason_of("no message_id"), DeadLetterReason::Malformed);
    assert_eq!(reason_of("exceeds the limit"), DeadLetterReason::Malformed);
    assert_eq!(reason_of("does not decode"), DeadLetterReason::DecodeError);
    // The contract refuses it when the body is decoded.
    assert_eq!(
        reason_of("amount must be 1 to"),
        DeadLetterReason::DecodeError
    );
    assert_eq!(reason_of("no handler"), DeadLetterReason::NoHandler);
    assert_eq!(dead.len(), 5);
    assert_eq!(stats.malformed, 2);
    assert_eq!(
        stats.processed, 1,
        "the good message after them is processed"
    );
    // An oversized body is kept as its prefix, its whole length and its digest.
    let cut = dead
        .iter()
        .find(|d| d.payload_cut.is_some())
        .expect("the oversized body is recorded as cut");
    assert_eq!(cut.payload, huge[..inbox_core::CUT_PAYLOAD_PREFIX]);
    let whole = cut.payload_cut.as_ref().unwrap();
    assert_eq!(whole.length, huge.len() as u64);
    assert_eq!(whole.sha256, inbox_core::PayloadCut::of(&huge).1.sha256);
    assert_eq!(
        queue_depth(&conn, &setup.topology.queue(&setup.group)).await,
        0
    );
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_declares_idempotently_and_names_conflicts() {
    let Some(setup) = Setup::new() else { return };
    let conn = amqp::connect(&setup.url).await;
    let topology = setup
        .topology
        .clone()
        .group(setup.group.clone(), [MESSAGE_TYPE]);
    // The check creates nothing: before the declare, the exchange is missing, and
    // then (not asked about the exchange) the group's queue.
    match topology.check(&conn, true).await {
        Err(inbox_amqp::Error::TopologyMissing { kind, name, .. }) => {
            assert_eq!((kind, name), ("exchange", topology.exchange()));
        }
        other => panic!("expected the exchange missing, got {other:?}"),
    }
    match topology.check(&conn, false).await {
        Err(inbox_amqp::Error::TopologyMissing { kind, name, .. }) => {
            assert_eq!((kind, name), ("queue", topology.queue(&setup.group)));
        }
        other => panic!("expected the queue missing, got {other:?}"),
    }
    topology.declare(&conn).await.unwrap();
    assert_eq!(
        topology.check(&conn, true).await.unwrap(),
        topology.queues(),
        "every queue checked once declared"
    );
    topology
        .declare(&conn)
        .await
        .expect("declaring twice is a no-op");
    let err = topology
        .clone()
        .delivery_limit(7)
        .declare(&conn)
        .await
        .expect_err("another delivery limit conflicts");
    let msg = err.to_string();
    assert!(
        matches!(err, inbox_amqp::Error::TopologyConflict { .. }),
        "{msg}"
    );
    assert!(msg.contains(&setup.topology.queue(&setup.group)), "{msg}");
    assert!(msg.contains("x-delivery-limit"), "{msg}");
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_dead_letters_at_its_delivery_limit_and_the_runtime_records_it() {
    use futures_lite::StreamExt;
    use lapin::options::{BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};

    let Some(setup) = Setup::new() else { return };
    let store = setup.store(DailyUsage::new(RetryPolicy::default()));
    let conn = amqp::connect(&setup.url).await;
    // A low backstop, so that a few returns reach it.
    let topology = setup
        .topology
        .clone()
        .delivery_limit(2)
        .group(setup.group.clone(), [MESSAGE_TYPE]);
    topology.declare(&conn).await.unwrap();
    let queue = topology.queue(&setup.group);
    let channel = confirm_channel(&conn).await;
    let event = body(&UsageRecorded {
        user_id: 4,
        day: NaiveDate::from_ymd_opt(2026, 11, 30).unwrap(),
        amount: 12,
    });
    // Without a `type` property: the type must survive the broker's dead-lettering,
    // which replaces the routing key with the dead-letter queue's name.
    publish_untyped(
        &channel,
        &topology.exchange(),
        "returned-again-and-again",
        &event,
    )
    .await;
    wait_for_confirms(&channel).await;

    // A consumer that hands the message back every time, as one that keeps dying on
    // it would: the broker counts each return and dead-letters past the limit.
    let returner = conn.create_channel().await.unwrap();
    returner
        .basic_qos(1, BasicQosOptions::default())
        .await
        .unwrap();
    let mut deliveries = returner
        .basic_consume(
            queue.as_str().into(),
            "returner".into(),
            BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let mut returns = 0;
    while let Ok(Some(delivery)) = tokio::time::timeout(ms(2000), deliveries.next()).await {
        let delivery = delivery.unwrap();
        // basic.reject: RabbitMQ 4.3 no longer counts a basic.nack toward the limit.
        returner
            .basic_reject(delivery.delivery_tag, BasicRejectOptions { requeue: true })
            .await
            .unwrap();
        returns += 1;
        assert!(returns <= 10, "the broker never applied its delivery limit");
    }
    let _ = returner.close(200, "returned".into()).await;
    // "Delivered unsuccessfully more than 2 times": the third return dead-letters it.
    assert_eq!(returns, 3);
    assert_eq!(queue_depth(&conn, &queue).await, 0);
    // At-least-once dead-lettering moves it to the group's dead-letter queue.
    let dlq = topology.dlq(&setup.group);
    let mut in_dlq = 0;
    for _ in 0..100 {
        in_dlq = queue_depth(&conn, &dlq).await;
        if in_dlq > 0 {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert_eq!(in_dlq, 1);

    let consumer = Consumer::new(setup.url.clone(), Arc::clone(&store), topology.clone())
        .with_settings(ConsumerSettings::default().workers(1));
    let stats = run_until(consumer, Duration::from_secs(30), |s| s.delivery_limit >= 1).await;
    assert_eq!(stats.delivery_limit, 1);
    assert_eq!(stats.processed, 0, "the message never reached a handler");
    let dead = store.dead_letters(&setup.group).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].key, "returned-again-and-again");
    assert_eq!(dead[0].reason, inbox_core::DeadLetterReason::DeliveryLimit);
    assert_eq!(dead[0].message_type, MESSAGE_TYPE);
    assert_eq!(dead[0].payload, event);
    // What is known of the attempts: the broker's three deliveries.
    assert_eq!(dead[0].attempts, 3);
    // The broker's own reason, from the x-first-death-reason header it set, and how
    // often it delivered the message (its limit plus one, per x-death).
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("(delivery_limit) after 3 deliveries"),
        "{:?}",
        dead[0].last_error
    );
    let claim = store
        .claim_record(&inbox_core::ClaimKey::new(
            setup.group.clone(),
            inbox_core::MessageKey::new("returned-again-and-again").unwrap(),
        ))
        .unwrap()
        .unwrap();
    assert_eq!(claim.status, ClaimStatus::Dead);
    assert!(totals(&store).is_empty(), "nothing was applied");
    assert_eq!(queue_depth(&conn, &dlq).await, 0);
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_delivery_is_traced_inside_its_batch() {
    let read_spans = inbox_test_support::spans::capture_globally();
    let Some(setup) = Setup::new() else { return };
    let store = setup.store(DailyUsage::new(RetryPolicy::default()));
    let consumer = setup.consumer(Arc::clone(&store));
    let conn = amqp::connect(&setup.url).await;
    consumer.topology().declare(&conn).await.unwrap();
    let channel = confirm_channel(&conn).await;
    let event = body(&UsageRecorded {
        user_id: 5,
        day: NaiveDate::from_ymd_opt(2026, 11, 30).unwrap(),
        amount: 1,
    });
    let keys = [unique_name("traced"), unique_name("traced")];
    for key in [&keys[0], &keys[1], &keys[0]] {
        publish(
            &channel,
            &consumer.topology().exchange(),
            &Outgoing {
                message_id: Some(key),
                message_type: MESSAGE_TYPE,
                body: &event,
                tenant: None,
            },
        )
        .await;
    }
    wait_for_confirms(&channel).await;
    let stats = run_until(consumer, Duration::from_secs(30), |s| {
        s.processed + s.duplicates >= 3
    })
    .await;
    assert_eq!((stats.processed, stats.duplicates), (2, 1));

    // Other tests of this binary run beside this one: look only at this test's keys.
    let spans = read_spans();
    let ours: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "inbox.delivery")
        .filter(|s| keys.iter().any(|k| s.fields.get("key") == Some(k)))
        .collect();
    assert_eq!(ours.len(), 3, "a span per delivery");
    let mut outcomes: Vec<&str> = ours.iter().map(|s| s.fields["outcome"].as_str()).collect();
    outcomes.sort_unstable();
    assert_eq!(outcomes, ["Duplicate", "Processed", "Processed"]);
    for delivery in ours {
        assert_eq!(delivery.fields["group"], GROUP);
        // delivery → the store's batch → the runtime's batch → its worker.
        let store_batch = &spans[delivery.parent_index.expect("a parent")];
        assert_eq!(store_batch.name, "inbox.batch");
        let amqp_batch = &spans[store_batch.parent_index.expect("a parent")];
        assert_eq!(amqp_batch.name, "inbox.amqp.batch");
        assert_eq!(amqp_batch.fields["group"], GROUP);
        let worker = &spans[amqp_batch.parent_index.expect("a parent")];
        assert_eq!(worker.name, "inbox.amqp.worker");
    }
    setup.cleanup().await;
}

/// The usage projection, failing transiently the first time it sees each user.
struct FailsOnceEach {
    group: ConsumerGroup,
    failed: std::sync::Mutex<std::collections::BTreeSet<i64>>,
}

impl Handler<PgConnection> for FailsOnceEach {
    type Message = UsageRecorded;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        MESSAGE_TYPE
    }

    fn handle(
        &self,
        conn: &mut PgConnection,
        msg: UsageRecorded,
        _: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        if self.failed.lock().unwrap().insert(msg.user_id) {
            return Err(HandlerError::transient(std::io::Error::other(
                "first try fails",
            )));
        }
        conn.add_usage(msg.user_id, msg.day, msg.amount)?;
        Ok(())
    }
}

/// Publishes with routing key = the message type and no `type` property, as the
/// contract allows.
async fn publish_untyped(channel: &lapin::Channel, exchange: &str, id: &str, body: &[u8]) {
    channel
        .basic_publish(
            exchange.into(),
            MESSAGE_TYPE.into(),
            lapin::options::BasicPublishOptions::default(),
            body,
            lapin::BasicProperties::default()
                .with_message_id(id.into())
                .with_delivery_mode(2),
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_a_type_property_keeps_its_type_through_a_retry_tier() {
    let Some(setup) = Setup::new() else { return };
    let handler = FailsOnceEach {
        group: setup.group.clone(),
        failed: Default::default(),
    };
    let store = setup.store_builder().handler(handler).build().unwrap();
    store.connection().unwrap().create_daily_usage().unwrap();
    let store = Arc::new(store);
    let consumer = setup.consumer(Arc::clone(&store));
    let conn = amqp::connect(&setup.url).await;
    consumer.topology().declare(&conn).await.unwrap();
    let channel = confirm_channel(&conn).await;
    let day = NaiveDate::from_ymd_opt(2026, 11, 30).unwrap();
    let event = body(&UsageRecorded {
        user_id: 3,
        day,
        amount: 9,
    });
    publish_untyped(&channel, &consumer.topology().exchange(), "untyped", &event).await;
    wait_for_confirms(&channel).await;

    let stats = run_until(consumer, Duration::from_secs(30), |s| {
        s.processed >= 1 || s.dead_lettered >= 1
    })
    .await;
    let dead = store.dead_letters(&setup.group).unwrap();
    assert!(dead.is_empty(), "dead-lettered: {dead:?}");
    assert_eq!((stats.retried, stats.processed), (1, 1), "{stats:?}");
    assert_eq!(totals(&store), BTreeMap::from([((3, day), 9)]));
    setup.cleanup().await;
}

/// A store that decides by the key's prefix (`stop-`: a claim invariant violated,
/// `retry-`: retry in 50 ms unless it came back from a retry tier, else processed) and
/// remembers every (group, key) it saw, and the halts it was told of: the transport's
/// side of each decision, without a database.
#[derive(Default)]
struct Scripted {
    seen: std::sync::Mutex<Vec<(String, String)>>,
    halts: std::sync::Mutex<BTreeMap<ConsumerGroup, inbox_core::ClaimInvariantViolated>>,
    /// Its groups, when not [`HALTING`] and [`GOING_ON`].
    groups: Option<[&'static str; 2]>,
    /// Recording a halt fails this many more times.
    record_failures: std::sync::atomic::AtomicUsize,
    /// The cause is fixed: `stop-` keys are processed.
    fixed: std::sync::atomic::AtomicBool,
    /// Reading the recorded halts fails.
    halts_unreadable: std::sync::atomic::AtomicBool,
}

impl inbox_core::GroupHalts for Scripted {
    fn record_halt(&self, cause: &inbox_core::ClaimInvariantViolated) -> inbox_core::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let failing = self
            .record_failures
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(inbox_core::Error::Store(Box::new(std::io::Error::other(
                "the store is down (scripted)",
            ))));
        }
        let mut halts = self.halts.lock().unwrap();
        halts
            .entry(cause.group.clone())
            .or_insert_with(|| cause.clone());
        Ok(())
    }

    fn halted_groups(&self) -> inbox_core::Result<Vec<inbox_core::ClaimInvariantViolated>> {
        if self
            .halts_unreadable
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(inbox_core::Error::Store(Box::new(std::io::Error::other(
                "the halts are unreadable (scripted)",
            ))));
        }
        Ok(self.halts.lock().unwrap().values().cloned().collect())
    }
}

const HALTING: &str = "scripted.halting";
const GOING_ON: &str = "scripted.going-on";

impl Scripted {
    fn seen(&self, group: &str) -> Vec<String> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|(g, _)| g == group)
            .map(|(_, k)| k.clone())
            .collect()
    }
}

impl inbox_core::InboxStore for Scripted {
    fn process_batch(
        &self,
        group: &ConsumerGroup,
        batch: &[inbox_core::Envelope],
    ) -> inbox_core::Result<Vec<inbox_core::Decision>> {
        use inbox_core::{ClaimInvariantViolated, Decision};
        let mut seen = self.seen.lock().unwrap();
        Ok(batch
            .iter()
            .map(|e| {
                let key = e.message_key.as_str();
                seen.push((group.to_string(), key.to_owned()));
                if key.starts_with("stop-") && !self.fixed.load(std::sync::atomic::Ordering::SeqCst)
                {
                    Decision::Stop(ClaimInvariantViolated {
                        group: group.clone(),
                        key: e.message_key.clone(),
                        detail: "a phantom conflict, scripted".to_owned(),
                    })
                } else if key.starts_with("retry-")
                    && !e.headers.contains_key("x-first-death-reason")
                {
                    Decision::RetryAfter(ms(50))
                } else {
                    Decision::Processed
                }
            })
            .collect())
    }

    fn routes(&self) -> Vec<(ConsumerGroup, String)> {
        self.groups
            .unwrap_or([HALTING, GOING_ON])
            .map(|g| (ConsumerGroup::new(g).unwrap(), format!("{g}.event")))
            .into()
    }

    fn dead_letter(
        &self,
        _: &ConsumerGroup,
        _: &inbox_core::Envelope,
        _: inbox_core::DeadLetterReason,
        _: &str,
    ) -> inbox_core::Result<inbox_core::DeadLetterOutcome> {
        Ok(inbox_core::DeadLetterOutcome::Recorded)
    }
}

/// The values gauges were last set to, by `name{labels}`, from a recorder installed
/// for the whole test binary (the consumer's tasks run on the runtime's threads).
fn gauges() -> &'static std::sync::Mutex<BTreeMap<String, f64>> {
    use metrics::{Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, SharedString, Unit};
    static GAUGES: std::sync::OnceLock<Arc<std::sync::Mutex<BTreeMap<String, f64>>>> =
        std::sync::OnceLock::new();
    struct Cell(String, Arc<std::sync::Mutex<BTreeMap<String, f64>>>);
    impl GaugeFn for Cell {
        fn increment(&self, v: f64) {
            *self.1.lock().unwrap().entry(self.0.clone()).or_default() += v;
        }
        fn decrement(&self, v: f64) {
            *self.1.lock().unwrap().entry(self.0.clone()).or_default() -= v;
        }
        fn set(&self, v: f64) {
            self.1.lock().unwrap().insert(self.0.clone(), v);
        }
    }
    struct Gauges(Arc<std::sync::Mutex<BTreeMap<String, f64>>>);
    impl metrics::Recorder for Gauges {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            Gauge::from_arc(Arc::new(Cell(name, Arc::clone(&self.0))))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }
    GAUGES.get_or_init(|| {
        let shared = Arc::default();
        metrics::set_global_recorder(Gauges(Arc::clone(&shared))).expect("the only recorder");
        shared
    })
}

/// Publishes `keys` to `group`'s message type, in order, and waits for the confirms.
async fn publish_keys(setup: &Setup, exchange: &str, group: &str, keys: &[&str]) {
    let conn = amqp::connect(&setup.url).await;
    let channel = confirm_channel(&conn).await;
    for key in keys {
        publish(
            &channel,
            exchange,
            &Outgoing {
                message_id: Some(key),
                message_type: &format!("{group}.event"),
                body: b"{}",
                tenant: None,
            },
        )
        .await;
    }
    wait_for_confirms(&channel).await;
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_halts_its_group_holds_its_delivery_and_the_other_groups_go_on() {
    let Some(setup) = Setup::new() else { return };
    let gauges = gauges();
    let store = Arc::new(Scripted::default());
    // One worker and a long batch wait: each group's first three messages make one
    // batch, the stop in the middle of it.
    let consumer = Consumer::new(
        setup.url.clone(),
        Arc::clone(&store),
        setup.topology.clone(),
    )
    .with_settings(
        ConsumerSettings::default()
            .workers(1)
            .prefetch(20)
            .batch(10, ms(300)),
    );
    let topology = consumer.topology().clone();
    let conn = amqp::connect(&setup.url).await;
    topology.declare(&conn).await.unwrap();
    let exchange = topology.exchange();
    publish_keys(&setup, &exchange, HALTING, &["a-1", "stop-a-2", "a-3"]).await;
    publish_keys(&setup, &exchange, GOING_ON, &["b-1", "b-2", "b-3"]).await;

    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let halted_and_going = eventually(Duration::from_secs(20), || {
        let s = stats.snapshot();
        s.halted.contains_key(HALTING) && s.processed >= 4
    })
    .await;
    assert!(halted_and_going, "{:?}", stats.snapshot());
    // After the halt: the other group takes new messages, the halted one does not.
    publish_keys(&setup, &exchange, HALTING, &["a-4"]).await;
    publish_keys(&setup, &exchange, GOING_ON, &["b-4", "b-5"]).await;
    let went_on = eventually(Duration::from_secs(20), || stats.snapshot().processed >= 6).await;
    tokio::time::sleep(ms(300)).await;
    assert!(!running.is_finished(), "the consumer keeps running");
    shutdown.cancel();
    running
        .await
        .unwrap()
        .expect("a halted group does not end the consumer");
    let snapshot = stats.snapshot();
    assert!(went_on, "{snapshot:?}");
    assert_eq!(
        snapshot.processed, 7,
        "a-1, a-3 and five of the other group"
    );
    assert!(
        snapshot.halted[HALTING].contains("a phantom conflict, scripted"),
        "{snapshot:?}"
    );
    assert_eq!(snapshot.halted.len(), 1, "{snapshot:?}");
    assert_eq!(store.seen(HALTING), ["a-1", "stop-a-2", "a-3"]);
    assert_eq!(store.seen(GOING_ON), ["b-1", "b-2", "b-3", "b-4", "b-5"]);
    // The stop was never acked (a `multiple` ack for a-3 would have covered it): it
    // is back in the queue with a-4, which the halted group never took.
    let halting = topology.queue(&ConsumerGroup::new(HALTING).unwrap());
    assert_eq!(queue_depth(&conn, &halting).await, 2);
    let going_on = topology.queue(&ConsumerGroup::new(GOING_ON).unwrap());
    assert_eq!(queue_depth(&conn, &going_on).await, 0);
    let halted_gauge = gauges
        .lock()
        .unwrap()
        .get(&format!("inbox_group_halted{{group={HALTING}}}"))
        .copied();
    assert_eq!(halted_gauge, Some(1.0));
    topology.delete(&conn).await.unwrap();
}

/// A halt the store fails to record keeps its group halted (it never resumes for a
/// record that is not there) and is written at a later poll; once the record is gone
/// the group resumes: the gauge back to 0, the stats no longer naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halt_the_store_fails_to_record_stays_halted_until_written_then_resumes() {
    const RESUMING: &str = "scripted.resuming";
    const BESIDE: &str = "scripted.beside";
    let Some(setup) = Setup::new() else { return };
    let gauges = gauges();
    let store = Arc::new(Scripted {
        groups: Some([RESUMING, BESIDE]),
        record_failures: 2.into(),
        ..Scripted::default()
    });
    let consumer = Consumer::new(
        setup.url.clone(),
        Arc::clone(&store),
        setup.topology.clone(),
    )
    .with_settings(
        ConsumerSettings::default()
            .workers(1)
            .prefetch(20)
            .batch(10, ms(5))
            .halt_poll(ms(50)),
    );
    let topology = consumer.topology().clone();
    let conn = amqp::connect(&setup.url).await;
    topology.declare(&conn).await.unwrap();
    let exchange = topology.exchange();
    publish_keys(&setup, &exchange, RESUMING, &["stop-1"]).await;
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let group = ConsumerGroup::new(RESUMING).unwrap();
    let gauge = || {
        gauges
            .lock()
            .unwrap()
            .get(&format!("inbox_group_halted{{group={RESUMING}}}"))
            .copied()
    };
    let recorded = eventually(Duration::from_secs(20), || {
        store.halts.lock().unwrap().contains_key(&group)
    })
    .await;
    assert!(recorded, "{:?}", stats.snapshot());
    assert_eq!(
        store.seen(RESUMING),
        ["stop-1"],
        "never resumed while its halt was not recorded"
    );
    assert!(stats.snapshot().halted.contains_key(RESUMING));
    assert_eq!(gauge(), Some(1.0));

    // Fixed and resumed: the held delivery comes back and is processed.
    store.fixed.store(true, std::sync::atomic::Ordering::SeqCst);
    store.halts.lock().unwrap().clear();
    publish_keys(&setup, &exchange, BESIDE, &["b-1"]).await;
    let resumed = eventually(Duration::from_secs(20), || {
        let s = stats.snapshot();
        s.halted.is_empty() && s.processed == 2
    })
    .await;
    assert!(resumed, "{:?}", stats.snapshot());
    assert_eq!(store.seen(RESUMING), ["stop-1", "stop-1"]);
    assert_eq!(gauge(), Some(0.0));
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(queue_depth(&conn, &topology.queue(&group)).await, 0);
    topology.delete(&conn).await.unwrap();
}

/// A consumer that cannot read the recorded halts does not start (it would resume a
/// halted group): `Consumer::run` fails with the store's error, before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_halts_cannot_be_read_fails_at_startup() {
    let Some(setup) = Setup::new() else { return };
    let store = Arc::new(Scripted {
        halts_unreadable: true.into(),
        ..Scripted::default()
    });
    let consumer = Consumer::new(setup.url.clone(), store, setup.topology.clone());
    // The timeout only keeps a consumer that wrongly started from hanging the test.
    let ran = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run(CancellationToken::new()),
    )
    .await
    .expect("the consumer ends at startup");
    let err = ran.unwrap_err();
    assert!(matches!(err, inbox_amqp::Error::Store(_)), "{err}");
    assert!(err.to_string().contains("store error"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_retry_tier_is_waited_out_with_backoff_not_hammered() {
    let Some(setup) = Setup::new() else { return };
    let store = Arc::new(Scripted::default());
    let consumer = Consumer::new(
        setup.url.clone(),
        Arc::clone(&store),
        setup.topology.clone(),
    )
    .with_settings(
        ConsumerSettings::default()
            .workers(1)
            .prefetch(20)
            .batch(10, ms(5))
            .backoff(ms(50), ms(400)),
    );
    let topology = consumer.topology().clone();
    let conn = amqp::connect(&setup.url).await;
    topology.declare(&conn).await.unwrap();
    let group = ConsumerGroup::new(GOING_ON).unwrap();
    let tier = topology.retry_queue(&group, ms(50));

    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    // Once the consumer has declared its topology and consumes, no copy gets into the
    // tier: the broker returns it (the tier is gone), the path of a copy the broker
    // nacks because the tier is full (`x-overflow reject-publish`). A full tier cannot
    // be held full here: its messages expire. The dead-letter reader declares the
    // topology too, on a connection of its own: both must be consuming before the tier
    // goes, or a late declaration brings it back.
    let channel = conn.create_channel().await.unwrap();
    let queue = topology.queue(&group);
    let dlq = topology.dlq(&group);
    let mut consuming = false;
    for _ in 0..500 {
        let mut consumers = 0;
        for name in [&queue, &dlq] {
            let q = channel
                .queue_declare(
                    name.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    Default::default(),
                )
                .await
                .unwrap();
            consumers += usize::from(q.consumer_count() > 0);
        }
        if consumers == 2 {
            consuming = true;
            break;
        }
        tokio::time::sleep(ms(20)).await;
    }
    assert!(
        consuming,
        "the consumer never consumed from {queue} and {dlq}"
    );
    channel
        .queue_delete(tier.as_str().into(), Default::default())
        .await
        .unwrap();
    let _ = channel.close(200, "done".into()).await;
    publish_keys(&setup, &topology.exchange(), GOING_ON, &["retry-1"]).await;
    // Two seconds against a full tier: backing off from 50 ms to 400 ms, a handful of
    // tries; requeued at once, as fast as the broker answers (hundreds).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let tries = stats.snapshot().requeued;
    assert!(
        (2..=15).contains(&tries),
        "{tries} tries against a full tier in 2 s: {:?}",
        stats.snapshot()
    );
    assert_eq!(stats.snapshot().retried, 0);

    // Room again: the retry goes through and comes back.
    topology.declare(&conn).await.unwrap();
    let done = eventually(Duration::from_secs(20), || stats.snapshot().processed >= 1).await;
    shutdown.cancel();
    running.await.unwrap().expect("consumer ends cleanly");
    let snapshot = stats.snapshot();
    assert!(done, "{snapshot:?}");
    assert_eq!(
        (snapshot.retried, snapshot.processed),
        (1, 1),
        "{snapshot:?}"
    );
    topology.delete(&conn).await.unwrap();
}
