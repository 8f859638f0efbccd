//! The consumer runtime against real RabbitMQ and PostgreSQL: each test has its own
//! schema, its own exchange and queue names (a prefix), and cleans its queues up.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDate;
use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, StatsSnapshot, Topology};
use inbox_core::{ConsumerGroup, Handler, HandlerError, MessageContext, RetryLadder, RetryPolicy};
use inbox_diesel::{ClaimStatus, Store, StoreBuilder};
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, Workload, GROUP, MESSAGE_TYPE};
use inbox_test_support::amqp::{
    self, amqp_url, confirm_channel, eventually, publish, queue_depth, wait_for_confirms, Outgoing,
};
use inbox_test_support::{unique_name, Fixture, PgFixture};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

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
        let prefix = format!("{}.", unique_name("t"));
        let topology = Topology::new("billing")
            .unwrap()
            .prefix(prefix)
            .unwrap()
            .ladder(RetryLadder::new([ms(50), ms(100), ms(200)]).unwrap())
            .queue_expires(Duration::from_secs(120));
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
        .claim(&inbox_core::ClaimKey::new(setup.group.clone(), key.clone()))
        .unwrap()
        .unwrap();
    assert_eq!((claim.status, claim.attempts), (ClaimStatus::Dead, 4));
    let dead = store.dead_letters(&setup.group).unwrap();
    assert_eq!(dead.len(), 1, "dead-lettered exactly once");
    assert_eq!(dead[0].reason, "max_attempts");
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
    let reasons: BTreeMap<String, String> = dead
        .iter()
        .map(|d| (d.last_error.clone().unwrap_or_default(), d.reason.clone()))
        .collect();
    let reason_of = |needle: &str| {
        reasons
            .iter()
            .find(|(err, _)| err.contains(needle))
            .map(|(_, r)| r.clone())
            .unwrap_or_else(|| panic!("no dead letter mentions {needle:?}: {reasons:?}"))
    };
    assert_eq!(reason_of("no message_id"), "malformed");
    assert_eq!(reason_of("exceeds the limit"), "malformed");
    assert_eq!(reason_of("does not decode"), "decode_error");
    assert_eq!(reason_of("amount must be positive"), "permanent");
    assert_eq!(reason_of("no handler"), "no_handler");
    assert_eq!(dead.len(), 5);
    assert_eq!(stats.malformed, 2);
    assert_eq!(
        stats.processed, 1,
        "the good message after them is processed"
    );
    assert!(
        dead.iter().any(|d| d.payload == huge),
        "the oversized body is kept"
    );
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
    topology.declare(&conn).await.unwrap();
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
    assert_eq!(dead[0].reason, "delivery_limit");
    assert_eq!(dead[0].message_type, MESSAGE_TYPE);
    assert_eq!(dead[0].payload, event);
    // The broker's own reason, from the x-first-death-reason header it set.
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("(delivery_limit)"),
        "{:?}",
        dead[0].last_error
    );
    let claim = store
        .claim(&inbox_core::ClaimKey::new(
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
