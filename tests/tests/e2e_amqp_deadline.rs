//! A handler that hangs, under the RabbitMQ consumer: past the store's batch deadline
//! the batch is abandoned (nothing acked, everything redelivered), the worker goes on,
//! the hung message is isolated and counted like a crash, and its neighbours are
//! applied once.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings};
use inbox_core::ConsumerGroup;
use inbox_diesel::Store;
use inbox_test_support::amqp::{self, amqp_url, confirm_channel, eventually, publish, Outgoing};
use inbox_test_support::ms;
use inbox_test_support::{Fixture, Outcome, PgFixture, Recorder, TestConn};

const GROUP: &str = "billing.daily-usage";
const TYPE: &str = "usage.recorded";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_handler_is_abandoned_isolated_and_dead_lettered_as_a_crash_loop() {
    let Some(url) = amqp_url() else { return };
    let Some(db) = PgFixture::new() else { return };
    let topology = amqp::test_topology(&amqp::unique_prefix("t"), &[50, 100]);
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "hang" {
            // Far longer than the batch deadline (the runtime waits for the
            // abandoned thread when the test ends, so not forever).
            Outcome::Sleep(Duration::from_secs(8))
        } else {
            Outcome::Apply
        }
    });
    let store = db
        .builder()
        .pool_size(8)
        .batch_deadline(ms(300))
        .statement_timeout(ms(150))
        .crash_limit(2)
        .retry_ladder(topology.retry_ladder().clone())
        .handler(handler)
        .build()
        .unwrap();
    db.connect().create_effects().unwrap();
    let store: Arc<Store<PgConnection>> = Arc::new(store);
    let consumer = Consumer::new(url.clone(), Arc::clone(&store), topology.clone())
        .with_settings(ConsumerSettings::default().workers(1).batch(10, ms(20)));
    let conn = amqp::connect(&url).await;
    consumer.topology().declare(&conn).await.unwrap();
    let channel = confirm_channel(&conn).await;
    let keys: Vec<String> = (0..5)
        .map(|i| format!("before-{i}"))
        .chain(["hang".to_owned()])
        .chain((0..5).map(|i| format!("after-{i}")))
        .collect();
    for key in &keys {
        publish(
            &channel,
            &topology.exchange(),
            &Outgoing {
                message_id: Some(key),
                message_type: TYPE,
                body: br#"{"amount": 1}"#,
                tenant: None,
            },
        )
        .await;
    }
    amqp::wait_for_confirms(&channel).await;

    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let group = ConsumerGroup::new(GROUP).unwrap();
    let finished = eventually(Duration::from_secs(12), || {
        let s = stats.snapshot();
        // A neighbour committed before its batch was abandoned comes back as a
        // duplicate: at-least-once delivery, exactly-once effects.
        s.processed + s.duplicates >= 10 && s.dead_lettered >= 1
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().expect("consumer ends cleanly");
    let snapshot = stats.snapshot();
    assert!(
        finished,
        "the consumer stalled behind a hung handler: {snapshot:?}"
    );
    let mut db_conn = db.connect();
    for key in keys.iter().filter(|k| *k != "hang") {
        assert_eq!(db_conn.effects_of(key).unwrap(), 1, "{key}");
    }
    assert_eq!(db_conn.effects_of("hang").unwrap(), 0);
    let dead = store.dead_letters(&group).unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (dead[0].key.as_str(), dead[0].reason.as_str()),
        ("hang", "crash_loop")
    );
    topology.group(group, [TYPE]).delete(&conn).await.unwrap();
}
