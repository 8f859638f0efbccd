//! A halted consumer group on PostgreSQL + RabbitMQ: its halt is recorded, an
//! operator resumes it without restarting the consumer (the held messages are then
//! applied exactly once), and a restart while it is halted keeps it halted. Each test
//! has its own schema and broker names, and cleans its queues up.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_core::ConsumerGroup;
use inbox_diesel::operator::Operator;
use inbox_diesel::Store;
use inbox_test_support::amqp::{
    self, amqp_url, confirm_channel, eventually, publish, queue_depth, raw, wait_for_confirms,
    Outgoing,
};
use inbox_test_support::{ms, Fixture, Outcome, PgFixture, Recorder, TestConn};

/// The group whose handler breaks its store's transaction on `stop-*` keys while the
/// cause is not fixed.
const HALTING: &str = "resume.halting";
/// The group beside it, which never halts.
const GOING_ON: &str = "resume.going-on";

type Calls = Arc<Mutex<Vec<String>>>;

struct Scene {
    db: PgFixture,
    url: String,
    topology: Topology,
    store: Arc<Store<PgConnection>>,
    /// The cause: while set, the halting group's handler rolls back the store's
    /// transaction on `stop-*` keys (a claim invariant violation: the group stops).
    broken: Arc<AtomicBool>,
    /// Set once a `slow-*` key's handler call began.
    slow_started: Arc<AtomicBool>,
    halting_calls: Calls,
    going_on_calls: Calls,
}

impl Scene {
    fn new() -> Option<Self> {
        let url = amqp_url()?;
        let db = PgFixture::new()?;
        let topology = amqp::test_topology(&amqp::unique_prefix("resume"), &[50, 100]);
        let broken = Arc::new(AtomicBool::new(true));
        let flag = Arc::clone(&broken);
        let slow_started = Arc::new(AtomicBool::new(false));
        let started = Arc::clone(&slow_started);
        let halting = Recorder::new(HALTING).behaviour(move |key, _| {
            let broken = flag.load(Ordering::SeqCst);
            if key.starts_with("slow-") {
                // A batch that started while the cause was there and ends after the
                // group was resumed: it stops on a run resumed since.
                started.store(true, Ordering::SeqCst);
                std::thread::sleep(ms(3000));
            }
            if (key.starts_with("stop-") || key.starts_with("slow-")) && broken {
                Outcome::IgnoreSql("ROLLBACK")
            } else {
                Outcome::Apply
            }
        });
        let going_on = Recorder::new(GOING_ON);
        let (halting_calls, going_on_calls) = (halting.calls(), going_on.calls());
        let store = db
            .builder()
            .pool_size(4)
            .retry_ladder(topology.retry_ladder().clone())
            .handler(halting)
            .handler(going_on)
            .build()
            .unwrap();
        TestConn::create_effects(&mut *store.connection().unwrap()).unwrap();
        Some(Self {
            db,
            url,
            topology,
            store: Arc::new(store),
            broken,
            slow_started,
            halting_calls,
            going_on_calls,
        })
    }

    fn consumer(&self, halt_poll: Duration) -> Consumer<Store<PgConnection>> {
        self.consumer_with(
            ConsumerSettings::default()
                .workers(1)
                .prefetch(20)
                .batch(10, ms(5)),
            halt_poll,
        )
    }

    fn consumer_with(
        &self,
        settings: ConsumerSettings,
        halt_poll: Duration,
    ) -> Consumer<Store<PgConnection>> {
        Consumer::new(
            self.url.clone(),
            Arc::clone(&self.store),
            self.topology.clone(),
        )
        .with_settings(settings.backoff(ms(50), ms(500)).halt_poll(halt_poll))
    }

    /// Publishes `keys` as `usage.recorded` (both groups take it) and waits for the
    /// confirms.
    async fn publish(&self, keys: &[&str]) {
        let conn = amqp::connect(&self.url).await;
        let channel = confirm_channel(&conn).await;
        let exchange = self.topology.exchange();
        for key in keys {
            publish(
                &channel,
                &exchange,
                &Outgoing {
                    message_id: Some(key),
                    message_type: "usage.recorded",
                    body: br#"{"amount":1}"#,
                    tenant: None,
                },
            )
            .await;
        }
        wait_for_confirms(&channel).await;
        let _ = conn.close(200, "done".into()).await;
    }

    /// How many effects `key` has: one per group that applied it.
    fn effects_of(&self, key: &str) -> i64 {
        self.db.connect().effects_of(key).unwrap()
    }

    fn halted_in_store(&self) -> Vec<String> {
        Operator::new(&self.store)
            .list_halted_groups()
            .unwrap()
            .into_iter()
            .map(|h| h.consumer_group)
            .collect()
    }

    async fn depth(&self, group: &str) -> u32 {
        self.depth_of(&self.topology.queue(&ConsumerGroup::new(group).unwrap()))
            .await
    }

    /// Messages ready in `queue` (not those a consumer holds unacked).
    async fn depth_of(&self, queue: &str) -> u32 {
        let conn = amqp::connect(&self.url).await;
        let depth = queue_depth(&conn, queue).await;
        let _ = conn.close(200, "done".into()).await;
        depth
    }

    /// The topology with both groups, as the consumer completes it.
    fn full_topology(&self) -> Topology {
        self.topology
            .clone()
            .with_routes(inbox_core::InboxStore::routes(&*self.store))
    }

    async fn declare(&self) {
        let conn = amqp::connect(&self.url).await;
        self.full_topology().declare(&conn).await.expect("declare");
        let _ = conn.close(200, "done".into()).await;
    }

    async fn cleanup(&self) {
        let conn = amqp::connect(&self.url).await;
        self.full_topology()
            .delete(&conn)
            .await
            .expect("delete topology");
        let _ = conn.close(200, "done".into()).await;
    }
}

fn calls_of(calls: &Calls, key: &str) -> usize {
    calls.lock().unwrap().iter().filter(|k| *k == key).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_group_resumes_without_a_restart_and_applies_its_held_messages_once() {
    let Some(scene) = Scene::new() else { return };
    scene.declare().await;
    scene.publish(&["a-1", "stop-1", "a-2"]).await;
    let consumer = scene.consumer(ms(100));
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));

    // The halting group halts and its halt is recorded; the other group applies all.
    let halted = eventually(Duration::from_secs(30), || {
        stats.snapshot().halted.contains_key(HALTING)
            && scene.halted_in_store() == [HALTING]
            && ["a-1", "stop-1", "a-2"]
                .iter()
                .all(|k| calls_of(&scene.going_on_calls, k) == 1)
    })
    .await;
    assert!(halted, "{:?}", stats.snapshot());
    let halt = &Operator::new(&scene.store).list_halted_groups().unwrap()[0];
    // The store stops the whole batch (the handler ended the batch's transaction):
    // the halt names its first message.
    assert!(
        ["a-1", "stop-1", "a-2"].contains(&halt.message_key.as_str()),
        "{halt:?}"
    );
    assert!(
        halt.detail.contains("resume.halting/usage.recorded"),
        "{halt:?}"
    );
    // While halted: the other group takes new messages, the halted one does not.
    scene.publish(&["a-3"]).await;
    let went_on = eventually(Duration::from_secs(30), || {
        calls_of(&scene.going_on_calls, "a-3") == 1
    })
    .await;
    assert!(went_on, "{:?}", stats.snapshot());
    assert_eq!(calls_of(&scene.halting_calls, "a-3"), 0);
    assert!(stats.snapshot().halted.contains_key(HALTING));

    // The cause is fixed, then the group resumed through the operator API.
    scene.broken.store(false, Ordering::SeqCst);
    assert!(Operator::new(&scene.store).resume_group(HALTING).unwrap());
    let resumed = eventually(Duration::from_secs(30), || {
        ["a-1", "stop-1", "a-2", "a-3"]
            .iter()
            .all(|k| scene.effects_of(k) == 2)
            && stats.snapshot().halted.is_empty()
    })
    .await;
    assert!(resumed, "{:?}", stats.snapshot());
    assert!(!running.is_finished(), "the consumer was not restarted");
    shutdown.cancel();
    running.await.unwrap().expect("the consumer ends cleanly");

    // Exactly once per group: the held messages were applied once after the resume,
    // the other group never saw a message twice.
    for key in ["a-1", "stop-1", "a-2", "a-3"] {
        assert_eq!(scene.effects_of(key), 2, "{key}");
        assert_eq!(calls_of(&scene.going_on_calls, key), 1, "{key}");
    }
    assert_eq!(
        calls_of(&scene.halting_calls, "stop-1"),
        2,
        "once broken, once fixed"
    );
    let snapshot = stats.snapshot();
    assert_eq!(snapshot.reconnects, 0, "{snapshot:?}");
    assert!(scene.halted_in_store().is_empty());
    assert_eq!(scene.depth(HALTING).await, 0);
    assert_eq!(scene.depth(GOING_ON).await, 0);
    scene.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_halted_keeps_the_group_halted() {
    let Some(scene) = Scene::new() else { return };
    scene.declare().await;
    scene.publish(&["stop-1"]).await;
    let consumer = scene.consumer(ms(100));
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let halted = eventually(Duration::from_secs(30), || {
        scene.halted_in_store() == [HALTING] && calls_of(&scene.going_on_calls, "stop-1") == 1
    })
    .await;
    assert!(halted, "{:?}", stats.snapshot());
    shutdown.cancel();
    running.await.unwrap().unwrap();

    // Restarted, even with the cause fixed: the recorded halt keeps the group halted
    // from the start (the poll is far off, so only the start can have read it).
    scene.broken.store(false, Ordering::SeqCst);
    let consumer = scene.consumer(Duration::from_secs(600));
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    scene.publish(&["a-1"]).await;
    let went_on = eventually(Duration::from_secs(30), || {
        calls_of(&scene.going_on_calls, "a-1") == 1
    })
    .await;
    assert!(went_on, "{:?}", stats.snapshot());
    let snapshot = stats.snapshot();
    assert!(
        snapshot.halted[HALTING].contains("resume.halting/usage.recorded"),
        "{snapshot:?}"
    );
    assert_eq!(
        scene.halting_calls.lock().unwrap().as_slice(),
        ["stop-1"],
        "the halted group took nothing after the restart"
    );
    assert_eq!(
        scene.depth(HALTING).await,
        2,
        "stop-1 and a-1 wait in its queue"
    );
    assert_eq!(scene.halted_in_store(), [HALTING]);
    shutdown.cancel();
    running.await.unwrap().unwrap();
    scene.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_of_a_run_resumed_since_never_halts_the_group_again() {
    let Some(scene) = Scene::new() else { return };
    scene.declare().await;
    // Two workers, one delivery each: one is busy with `slow-1` (3 s, begun while the
    // cause is there) when the other halts the group on `stop-1`.
    let consumer = scene.consumer_with(
        ConsumerSettings::default()
            .workers(2)
            .prefetch(1)
            .batch(1, ms(5)),
        ms(50),
    );
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    scene.publish(&["slow-1"]).await;
    let slow = eventually(Duration::from_secs(30), || {
        scene.slow_started.load(Ordering::SeqCst)
    })
    .await;
    assert!(slow, "{:?}", stats.snapshot());
    scene.publish(&["stop-1"]).await;
    let halted = eventually(Duration::from_secs(30), || {
        scene.halted_in_store() == [HALTING]
    })
    .await;
    assert!(halted, "{:?}", stats.snapshot());

    // Resumed while `slow-1`'s batch still runs; that batch then stops on the old run.
    scene.broken.store(false, Ordering::SeqCst);
    assert!(Operator::new(&scene.store).resume_group(HALTING).unwrap());
    let applied = eventually(Duration::from_secs(30), || {
        scene.effects_of("slow-1") == 2 && scene.effects_of("stop-1") == 2
    })
    .await;
    assert!(
        applied,
        "{:?}; halted in the store: {:?}",
        stats.snapshot(),
        scene.halted_in_store()
    );
    // Past a few polls: the stale stop recorded no halt, and the group consumes.
    tokio::time::sleep(ms(300)).await;
    assert!(scene.halted_in_store().is_empty());
    assert!(stats.snapshot().halted.is_empty(), "{:?}", stats.snapshot());
    assert_eq!(
        calls_of(&scene.halting_calls, "slow-1"),
        2,
        "once before the resume, once after"
    );
    shutdown.cancel();
    running.await.unwrap().expect("the consumer ends cleanly");
    assert_eq!(scene.depth(HALTING).await, 0);
    scene.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_halts_its_group_holds_its_delivery_even_as_a_cautious_session_ends() {
    let Some(scene) = Scene::new() else { return };
    scene.declare().await;
    let halting = ConsumerGroup::new(HALTING).unwrap();
    // A cautious session relaxes once `prefetch` (2) deliveries settled: here the
    // second is the one that halts the group.
    let consumer = scene.consumer_with(
        ConsumerSettings::default()
            .workers(1)
            .prefetch(2)
            .batch(1, ms(5)),
        Duration::from_secs(600),
    );
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    // A message the client cannot parse, straight into the halting group's queue: its
    // workers' connection fails on it until the queue's delivery limit parks it.
    let poison = raw::Properties {
        message_id: Some(b"bad-\xff\xfe-id".to_vec()),
        message_type: Some(b"usage.recorded".to_vec()),
        headers: None,
    };
    raw::publish(
        &scene.url,
        "",
        &scene.topology.queue(&halting),
        &poison,
        br#"{"amount":1}"#,
    )
    .await
    .expect("the broker takes the poison");
    let unreadable = scene.topology.unreadable(&halting);
    let mut parked = false;
    for _ in 0..600 {
        if scene.depth_of(&unreadable).await >= 1 {
            parked = true;
            break;
        }
        tokio::time::sleep(ms(100)).await;
    }
    assert!(parked, "the poison was not parked: {:?}", stats.snapshot());

    // The workers' session is cautious now: `a-1` settles one, `stop-1` halts.
    scene.publish(&["a-1", "stop-1"]).await;
    let halted = eventually(Duration::from_secs(30), || {
        scene.halted_in_store() == [HALTING] && calls_of(&scene.halting_calls, "stop-1") == 1
    })
    .await;
    assert!(halted, "{:?}", stats.snapshot());
    tokio::time::sleep(ms(500)).await;
    assert_eq!(
        scene.depth(HALTING).await,
        0,
        "stop-1 is held by the halted group's worker, not handed back to the queue"
    );
    assert_eq!(calls_of(&scene.halting_calls, "stop-1"), 1);
    assert_eq!(scene.effects_of("a-1"), 2);
    shutdown.cancel();
    running.await.unwrap().expect("the consumer ends cleanly");
    scene.cleanup().await;
}
