//! Fault scenarios on a RabbitMQ cluster of the test's own (three nodes on loopback,
//! see `inbox_test_support::rabbit_cluster`), each with a ledger of every message
//! published and a verdict at the end: none lost, none doubled (duplicates are
//! published on purpose), the projection equals the ledger, the queue drained.
//!
//! The consumer and, in every scenario but the first, the relay publishing the outbox
//! are given the three nodes' URLs in one setting; the group's queues are quorum
//! queues with a replica on each node. Where a relay runs, the verdict also asks that
//! every outbox row ends published. The short form runs in CI; the long
//! form (`INBOX_CLUSTER_LONG=1`) publishes ten times as much.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use diesel::PgConnection;
use inbox_amqp::{
    CancellationToken, Consumer, ConsumerSettings, ConsumerStats, Relay, RelaySettings, RelayStats,
    Topology,
};
use inbox_core::ConsumerGroup;
use inbox_diesel::{enqueue, Store};
use inbox_examples::usage::{
    diff_totals, quick_policy, DailyUsage, UsageDb, Workload, GROUP, MESSAGE_TYPE,
};
use inbox_test_support::amqp::{self, confirm_channel, publish, wait_for_confirms, Outgoing};
use inbox_test_support::rabbit_cluster::{available, RabbitCluster};
use inbox_test_support::PgFixture;

/// How many distinct events a scenario publishes (and a tenth again as duplicates).
fn events() -> usize {
    if std::env::var_os("INBOX_CLUSTER_LONG").is_some() {
        30_000
    } else {
        3_000
    }
}

/// How long a scenario waits for its stream to get going: a minute, ten in the long
/// form (ten times the events).
fn patience() -> Duration {
    Duration::from_secs(60 * u64::try_from(events() / 3_000).unwrap_or(1).max(1))
}

/// One scenario at a time: three nodes each are what two cores hold.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A cluster scenario's parts: the cluster, a schema, the consumer's store.
struct Scene {
    cluster: RabbitCluster,
    db: PgFixture,
    store: Arc<Store<PgConnection>>,
    topology: Topology,
    runtime: tokio::runtime::Runtime,
    /// Last: the next scenario starts once this one's nodes are gone.
    _one: std::sync::MutexGuard<'static, ()>,
}

impl Scene {
    fn new() -> Option<Self> {
        if !available() {
            assert!(
                !inbox_test_support::services_required(),
                "no RabbitMQ install for a cluster of the test's own"
            );
            return None;
        }
        let one = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let db = PgFixture::new()?;
        let cluster = RabbitCluster::start(3).unwrap();
        let store = Store::<PgConnection>::builder(db.url())
            .schema(&db.schema)
            .pool_size(4)
            .handler(DailyUsage::new(quick_policy()))
            .build()
            .unwrap();
        store.connection().unwrap().create_daily_usage().unwrap();
        let topology = amqp::test_topology(&amqp::unique_prefix("cluster"), &[50, 100])
            .quorum_initial_group_size(3)
            .group(ConsumerGroup::new(GROUP).unwrap(), [MESSAGE_TYPE]);
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let conn = inbox_amqp::connect(&cluster.url_list(), None)
                .await
                .unwrap();
            topology.declare(&conn).await.unwrap();
        });
        Some(Self {
            cluster,
            db,
            store: Arc::new(store),
            topology,
            runtime,
            _one: one,
        })
    }

    fn queue(&self) -> String {
        self.topology.queue(&ConsumerGroup::new(GROUP).unwrap())
    }

    /// Publishes every event of `workload` and a tenth of them again, confirmed by
    /// the cluster (a confirm of a quorum queue: a majority of replicas hold it).
    fn publish(&self, workload: &Workload) -> usize {
        self.publish_range(workload, 0..workload.events.len())
    }

    /// Publishes events `range` of `workload` and a tenth of them again, as
    /// [`publish`](Self::publish).
    fn publish_range(&self, workload: &Workload, range: std::ops::Range<usize>) -> usize {
        let exchange = self.topology.exchange();
        let urls = self.cluster.url_list();
        self.runtime.block_on(async {
            let conn = inbox_amqp::connect(&urls, None).await.unwrap();
            let channel = confirm_channel(&conn).await;
            let events = &workload.events[range];
            let again = events.iter().step_by(10);
            let mut published = 0;
            for (key, event) in events.iter().chain(again) {
                let body = serde_json::to_vec(event).unwrap();
                let msg = Outgoing {
                    message_id: Some(key.as_str()),
                    message_type: MESSAGE_TYPE,
                    body: &body,
                    tenant: None,
                };
                publish(&channel, &exchange, &msg).await;
                published += 1;
            }
            wait_for_confirms(&channel).await;
            published
        })
    }

    /// Waits (up to two minutes) until every published copy was delivered at least
    /// once and the group's queue holds no ready message, so that the duplicates the
    /// verdict speaks of were consumed, not left in the queue.
    fn drained(&self, stats: &ConsumerStats, published: usize) -> bool {
        let (urls, queue) = (self.cluster.url_list(), self.queue());
        let published = u64::try_from(published).unwrap();
        self.runtime.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            while tokio::time::Instant::now() < deadline {
                if stats.snapshot().received >= published {
                    if let Ok(conn) = inbox_amqp::connect(&urls, None).await {
                        let depth = amqp::queue_depth(&conn, &queue).await;
                        let _ = conn.close(200, "drained?".into()).await;
                        if depth == 0 {
                            return true;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            false
        })
    }

    /// Blocks (up to a minute) until the consumer has processed `n` events.
    fn reached(&self, stats: &ConsumerStats, n: usize) -> bool {
        let n = u64::try_from(n).unwrap();
        self.runtime.block_on(amqp::eventually(patience(), || {
            stats.snapshot().processed >= n
        }))
    }

    /// The end of every scenario: waits (up to three minutes) for every distinct event
    /// to be settled and every outbox row published, then for every copy to be
    /// delivered, stops the consumer and the relay, prints `what` with their counters
    /// and checks the verdict; `reconnected` when the scenario must have made both
    /// reconnect.
    fn finish(&self, what: &str, end: Ending<'_>, reconnected: bool) {
        let Ending {
            workload,
            published,
            stats,
            relay,
            shutdown,
            running,
        } = end;
        let all = i64::try_from(workload.events.len()).unwrap();
        let (db, schema) = (self.db.url().to_owned(), self.db.schema.clone());
        let done = self
            .runtime
            .block_on(amqp::eventually(Duration::from_secs(180), || {
                unpublished(&db, &schema) == 0 && settled(&db, &schema) >= all
            }));
        let relayed = relay.as_ref().map_or(0, |r| r.stats.snapshot().published);
        let published = published + usize::try_from(relayed).unwrap();
        let drained = self.drained(&stats, published);
        shutdown.cancel();
        self.runtime.block_on(running).unwrap().unwrap();
        let relayed = relay.map(|relay| {
            self.runtime.block_on(relay.running).unwrap().unwrap();
            relay.stats.snapshot()
        });
        let stats = stats.snapshot();
        eprintln!("{what}: consumer {stats:?}, relay {relayed:?}");
        assert!(
            done,
            "not every row published and applied: {stats:?} {relayed:?}"
        );
        assert!(drained, "copies left undelivered in the queue: {stats:?}");
        if reconnected {
            assert!(
                stats.reconnects >= 1,
                "the consumer lost its node: {stats:?}"
            );
            if let Some(relayed) = &relayed {
                assert!(
                    relayed.reconnects >= 1,
                    "the relay lost its node: {relayed:?}"
                );
            }
        }
        self.verdict(workload, published);
    }

    /// The cluster's URLs in one setting with the node leading `queue` first (the
    /// relay and the consumer connect to it, and lose it), and that node.
    fn leader_first(&self, queue: &str) -> (usize, String) {
        let leader = self
            .cluster
            .leader_of(queue)
            .expect("the queue has a leader");
        let urls = self.cluster.urls();
        let mut list = vec![urls[leader].clone()];
        list.extend(
            (0..urls.len())
                .filter(|i| *i != leader)
                .map(|i| urls[i].clone()),
        );
        (leader, list.join(" "))
    }

    /// A relay of the scene's outbox to the brokers of `urls`.
    fn relay_of(&self, urls: String) -> Relay<Store<PgConnection>> {
        self.relay_with(urls, relay_settings())
    }

    fn relay_with(&self, urls: String, settings: RelaySettings) -> Relay<Store<PgConnection>> {
        Relay::new(urls, Arc::clone(&self.store)).with_settings(settings)
    }

    /// Enqueues the events of `workload` at `order` into the outbox, each in a
    /// transaction of its own, at about `rate` a second, on a thread of its own.
    fn produce(&self, workload: &Workload, order: Vec<usize>, rate: f64) -> Producer {
        let enqueued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (store, counted) = (Arc::clone(&self.store), Arc::clone(&enqueued));
        let (events, exchange) = (workload.events.clone(), self.topology.exchange());
        let thread = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            for (i, at) in order.into_iter().enumerate() {
                let due = started + Duration::from_secs_f64(i as f64 / rate);
                if let Some(wait) = due.checked_duration_since(std::time::Instant::now()) {
                    std::thread::sleep(wait);
                }
                let (key, event) = &events[at];
                let body = serde_json::to_vec(event).unwrap();
                let msg =
                    inbox_core::OutboxMessage::new(key.clone(), &exchange, MESSAGE_TYPE, body);
                let mut conn = store.connection().unwrap();
                enqueue(&mut conn, &msg, store.clock().now()).unwrap();
                counted.store(i + 1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        Producer { thread, enqueued }
    }

    fn consumer(&self) -> Consumer<Store<PgConnection>> {
        self.consumer_of(self.cluster.url_list())
    }

    fn consumer_of(&self, urls: String) -> Consumer<Store<PgConnection>> {
        Consumer::new(urls, Arc::clone(&self.store), self.topology.clone()).with_settings(
            ConsumerSettings::default()
                .workers(1)
                .prefetch(20)
                .batch(10, Duration::from_millis(2))
                .backoff(Duration::from_millis(50), Duration::from_millis(1_000))
                .connect_timeout(Duration::from_secs(2)),
        )
    }

    /// The verdict: every distinct event applied once (none lost, none doubled),
    /// the projection equal to the ledger.
    fn verdict(&self, workload: &Workload, published: usize) {
        let found = self.store.connection().unwrap().daily_totals().unwrap();
        let expected = workload.expected_totals();
        let diffs = diff_totals(&expected, &found);
        let settled = settled(self.db.url(), &self.db.schema);
        let distinct = i64::try_from(workload.events.len()).unwrap();
        eprintln!(
            "ledger: {published} published ({} distinct), {settled} claims settled, \
             lost {}, doubled {}, projection {}",
            workload.events.len(),
            (distinct - settled).max(0),
            (settled - distinct).max(0),
            if diffs.is_empty() {
                "equals the ledger"
            } else {
                "differs"
            }
        );
        assert!(diffs.is_empty(), "the projection differs: {diffs:?}");
        assert_eq!(settled, distinct, "one claim per distinct event");
    }
}

/// The scenarios' relay settings: short leases and pauses.
fn relay_settings() -> RelaySettings {
    RelaySettings::default()
        .relay_id("cluster")
        .lease(100, Duration::from_secs(2))
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_millis(50), Duration::from_millis(1_000))
        .connect_timeout(Duration::from_secs(2))
}

/// A running scenario, handed to [`Scene::finish`]: what was published straight
/// to the broker, the consumer, and the relay if one runs.
struct Ending<'w> {
    workload: &'w Workload,
    published: usize,
    stats: Arc<ConsumerStats>,
    relay: Option<Relaying>,
    shutdown: CancellationToken,
    running: tokio::task::JoinHandle<inbox_amqp::Result<()>>,
}

/// A running relay.
struct Relaying {
    stats: Arc<RelayStats>,
    running: tokio::task::JoinHandle<inbox_amqp::Result<()>>,
}

/// Producers enqueueing into the outbox (see [`Scene::produce`]).
struct Producer {
    thread: std::thread::JoinHandle<()>,
    enqueued: Arc<std::sync::atomic::AtomicUsize>,
}

impl Producer {
    /// How many rows are enqueued so far.
    fn enqueued(&self) -> usize {
        self.enqueued.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until every row is enqueued.
    fn join(self) {
        self.thread.join().unwrap();
    }
}

/// `SELECT COUNT(*) AS n FROM <from>` in `schema`; `None` when it cannot be read.
fn count(db_url: &str, schema: &str, from: &str) -> Option<i64> {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = PgConnection::establish(db_url).ok()?;
    conn.batch_execute(&format!("SET search_path TO \"{schema}\""))
        .ok()?;
    diesel::sql_query(format!("SELECT COUNT(*) AS n FROM {from}"))
        .get_result::<N>(&mut conn)
        .map(|r| r.n)
        .ok()
}

/// Whether `queue` exists on the brokers of `urls` (a passive declaration).
async fn exists(urls: &str, queue: &str) -> bool {
    let Ok(conn) = inbox_amqp::connect(urls, None).await else {
        return false;
    };
    let Ok(channel) = conn.create_channel().await else {
        return false;
    };
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let found = channel
        .queue_declare(queue.into(), passive, lapin::types::FieldTable::default())
        .await
        .is_ok();
    let _ = conn.close(200, "looked".into()).await;
    found
}

/// Claims settled (done or dead) in `schema`.
fn settled(db_url: &str, schema: &str) -> i64 {
    let from = "inbox_claims WHERE status IN ('done', 'dead')";
    count(db_url, schema, from).unwrap_or(0)
}

/// Claims dead in `schema`.
fn dead(db_url: &str, schema: &str) -> i64 {
    count(db_url, schema, "inbox_claims WHERE status = 'dead'").unwrap_or(-1)
}

/// Outbox rows not yet published in `schema`.
fn unpublished(db_url: &str, schema: &str) -> i64 {
    let from = "outbox_messages WHERE published_at IS NULL";
    count(db_url, schema, from).unwrap_or(i64::MAX)
}

/// `kill -9` of the node leading the group's queue while the consumer is mid-stream:
/// the queue's replicas elect a new leader, the consumer moves to a live node and
/// goes on; what was delivered and not acked comes back and is dropped as a
/// duplicate or applied once.
#[test]
fn kill_dash_nine_of_the_queues_leader_mid_stream_loses_and_doubles_nothing() {
    let Some(mut scene) = Scene::new() else {
        return;
    };
    let workload = Workload::generate(events(), 0, 41);
    let published = scene.publish(&workload);
    let queue = scene.queue();
    let leader = scene
        .cluster
        .leader_of(&queue)
        .expect("the queue has a leader");
    let consumer = scene.consumer();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = scene.runtime.spawn(consumer.run(shutdown.clone()));
    let started = scene.reached(&stats, events() / 10);
    assert!(
        started,
        "the consumer did not start: {:?}",
        stats.snapshot()
    );
    scene.cluster.kill_node(leader).unwrap();
    let at_kill = stats.snapshot();
    assert!(
        at_kill.processed < u64::try_from(events()).unwrap(),
        "the kill did not land mid-stream: {at_kill:?}"
    );
    let what = format!(
        "leader node {leader} killed at {} processed",
        at_kill.processed
    );
    let end = Ending {
        workload: &workload,
        published,
        stats,
        relay: None,
        shutdown,
        running,
    };
    scene.finish(&what, end, true);
    eprintln!("new leader {:?}", scene.cluster.leader_of(&queue));
}

/// A real election, waited for: two of the three nodes are killed (`kill -9`), so
/// the group's queue has no majority and no leader, and the survivor answers what a
/// node answers then (checked first: a consume of the test's own is answered `541
/// INTERNAL_ERROR`). The consumer and the relay start then, with every node's URL
/// and a backlog in the queue and the outbox: they reach the survivor, are told the
/// queue has no leader, and wait, the consumer until its consume is answered so and
/// it has reconnected. Neither ends; nothing is applied, retried or dead-lettered;
/// the relay's rows are nacked more than its `max_attempts` (2 here) and none is
/// made dead. A service started then with a topology of its own (`serve`) is
/// answered `541` to the declaration of its new queues and waits too. When the two
/// nodes are back, the replicas elect a leader and all go on: every event applied
/// once, every outbox row published, the service's queues declared.
#[test]
fn a_queue_without_a_leader_is_waited_for_until_an_election_gives_it_one() {
    let Some(mut scene) = Scene::new() else {
        return;
    };
    let workload = Workload::generate(events(), 0, 61);
    let published = scene.publish(&workload);
    scene
        .produce(&workload, (0..events()).collect(), 50_000.0)
        .join();
    let queue = scene.queue();
    let leader = scene
        .cluster
        .leader_of(&queue)
        .expect("the queue has a leader");
    let other = (leader + 1) % 3;
    let survivor = (leader + 2) % 3;
    scene.cluster.kill_node(leader).unwrap();
    scene.cluster.kill_node(other).unwrap();
    let killed = std::time::Instant::now();

    // What the survivor answers: a consume needs the queue's leader (RabbitMQ
    // 3.10 answers after about a minute); the consumer and the relay start
    // meanwhile.
    let probe_url = scene.cluster.urls()[survivor].clone();
    let probed = queue.clone();
    let probe = scene.runtime.spawn(async move {
        let conn = inbox_amqp::connect(&probe_url, None).await.unwrap();
        let channel = conn.create_channel().await.unwrap();
        let consuming = channel.basic_consume(
            probed.as_str().into(),
            "probe".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        );
        let consumed = tokio::time::timeout(Duration::from_secs(180), consuming)
            .await
            .expect("no answer to a consume within 3 minutes");
        let _ = conn.close(200, "probed".into()).await;
        consumed.err().map(|err| err.to_string())
    });
    let shutdown = CancellationToken::new();
    // A service started now, with a topology of its own (new queues, which need a
    // majority of their replicas to be created): `serve` declares it first, and
    // RabbitMQ answers that declaration `541` ("cannot declare quorum queue ...:
    // cluster_not_formed", after about 15 s); `serve` waits it out too.
    let fresh_db = PgFixture::new().unwrap();
    let fresh_store = Store::<PgConnection>::builder(fresh_db.url())
        .schema(&fresh_db.schema)
        .handler(DailyUsage::new(quick_policy()))
        .build()
        .unwrap();
    fresh_store
        .connection()
        .unwrap()
        .create_daily_usage()
        .unwrap();
    let fresh_store = Arc::new(fresh_store);
    let fresh = amqp::test_topology(&amqp::unique_prefix("fresh"), &[50])
        .quorum_initial_group_size(3)
        .group(ConsumerGroup::new(GROUP).unwrap(), [MESSAGE_TYPE]);
    let fresh_queue = fresh.queue(&ConsumerGroup::new(GROUP).unwrap());
    let serving = scene.runtime.spawn(inbox_amqp::serve(
        Consumer::new(scene.cluster.url_list(), Arc::clone(&fresh_store), fresh)
            .with_settings(ConsumerSettings::default().connect_timeout(Duration::from_secs(2))),
        Relay::new(scene.cluster.url_list(), fresh_store).with_settings(relay_settings()),
        shutdown.clone(),
    ));
    let consumer = scene.consumer();
    let stats = consumer.stats();
    let relay = scene.relay_with(scene.cluster.url_list(), relay_settings().max_attempts(2));
    let relayed = relay.stats();
    let running = scene.runtime.spawn(consumer.run(shutdown.clone()));
    let relaying = scene.runtime.spawn(relay.run(shutdown.clone()));
    let answer = scene.runtime.block_on(probe).unwrap();
    let answer = answer.expect("a consume from a queue without a leader succeeded");
    eprintln!(
        "the survivor answered a consume after {:?}: {answer}",
        killed.elapsed()
    );
    assert!(
        answer.contains("INTERNAL_ERROR"),
        "not an election's answer: {answer}"
    );
    let answered = scene
        .runtime
        .block_on(amqp::eventually(Duration::from_secs(180), || {
            stats.snapshot().reconnects >= 1
        }));
    let (waiting, relay_waiting) = (stats.snapshot(), relayed.snapshot());
    let (db, schema) = (scene.db.url().to_owned(), scene.db.schema.clone());
    eprintln!(
        "no leader for {:?}: consumer {waiting:?}, relay {relay_waiting:?}",
        killed.elapsed()
    );
    assert!(answered, "the consumer was not answered and reconnected");
    assert!(
        !running.is_finished() && !relaying.is_finished(),
        "a queue without a leader ended the consumer or the relay"
    );
    assert!(
        !serving.is_finished(),
        "serve's declaration without a majority ended it: {:?}",
        scene.runtime.block_on(serving)
    );
    assert_eq!(
        (waiting.processed, waiting.retried, waiting.dead_lettered),
        (0, 0, 0),
        "a queue without a leader was paid for by the consumer's messages"
    );
    let claims = count(&db, &schema, "inbox_claims");
    assert_eq!(claims, Some(0), "applied without a leader");
    // Refused: nacked, or (a confirm that did not come within the 2 s lease) left
    // unanswered; either way never a row's last try.
    let refused = "outbox_messages WHERE (last_error = 'nacked by the broker' \
                   OR last_error LIKE 'no answer from the broker%') AND attempts > 2";
    assert!(
        relay_waiting.nacked > 0 && count(&db, &schema, refused).unwrap_or(0) > 0,
        "no row refused more than max_attempts times: {relay_waiting:?}"
    );
    assert_eq!(
        count(&db, &schema, "outbox_messages WHERE dead_at IS NOT NULL"),
        Some(0),
        "the relay's refusals made rows dead: {relay_waiting:?}"
    );

    scene.cluster.restart_node(leader).unwrap();
    scene.cluster.restart_node(other).unwrap();
    let end = Ending {
        workload: &workload,
        published,
        stats: Arc::clone(&stats),
        relay: Some(Relaying {
            stats: relayed,
            running: relaying,
        }),
        shutdown,
        running,
    };
    let what = format!("nodes {leader} and {other} killed, then back");
    // The service's queues are declared once the nodes are back.
    let urls = scene.cluster.url_list();
    let give_up = std::time::Instant::now() + Duration::from_secs(120);
    let declared = loop {
        if scene.runtime.block_on(exists(&urls, &fresh_queue)) {
            break true;
        }
        if std::time::Instant::now() > give_up {
            break false;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    scene.finish(&what, end, false);
    assert!(declared, "serve never declared its topology");
    assert!(
        scene.runtime.block_on(serving).unwrap().is_ok(),
        "serve did not end cleanly"
    );
    let after = stats.snapshot();
    assert_eq!(
        (after.retried, after.dead_lettered, dead(&db, &schema)),
        (0, 0, 0),
        "the election was paid for by its messages"
    );
    eprintln!("leader elected: node {:?}", scene.cluster.leader_of(&queue));
}

/// A rolling restart of the three nodes (each stopped and started again in turn,
/// the next only once it is back), a wave of events published before each and the
/// node stopped while the wave is being consumed. The same events go through the
/// outbox too, enqueued once each wave is published, and the relay (connected
/// first, like the consumer, to the node stopped first) publishes them across the
/// restarts: both reconnect, and each event is applied once whichever way it came.
#[test]
fn a_rolling_restart_of_the_three_nodes_loses_and_doubles_nothing() {
    let Some(mut scene) = Scene::new() else {
        return;
    };
    let wave = events() / 3;
    let workload = Workload::generate(wave * 3, 0, 43);
    let consumer = scene.consumer();
    let stats = consumer.stats();
    let relay = scene.relay_of(scene.cluster.url_list());
    let relayed = relay.stats();
    let shutdown = CancellationToken::new();
    let running = scene.runtime.spawn(consumer.run(shutdown.clone()));
    let relaying = scene.runtime.spawn(relay.run(shutdown.clone()));
    let mut published = 0;
    for node in 0..3 {
        let range = node * wave..(node + 1) * wave;
        published += scene.publish_range(&workload, range.clone());
        let producer = scene.produce(&workload, range.collect(), 1_000.0);
        let started = scene.reached(&stats, node * wave + wave / 10);
        assert!(started, "wave {node} not consumed: {:?}", stats.snapshot());
        scene.cluster.stop_node(node).unwrap();
        scene.cluster.restart_node(node).unwrap();
        producer.join();
    }
    let end = Ending {
        workload: &workload,
        published,
        stats,
        relay: Some(Relaying {
            stats: relayed,
            running: relaying,
        }),
        shutdown,
        running,
    };
    scene.finish("rolling restart", end, true);
}

/// The first node of the consumer and the relay reached through a proxy that then
/// cuts them off (the node itself stays up): both move to the next node of their
/// list. The events are published straight to the broker and, at the same time,
/// enqueued into the outbox (about 1,000 a second) for the relay.
#[test]
fn a_client_cut_from_one_node_moves_to_another_and_loses_nothing() {
    let Some(scene) = Scene::new() else { return };
    let workload = Workload::generate(events(), 0, 47);
    let published = scene.publish(&workload);
    let urls = scene.cluster.urls();
    let proxy = scene
        .runtime
        .block_on(amqp::Proxy::start(amqp::host_port(&urls[0])));
    let list = format!("{} {} {}", proxy.url_for(&urls[0]), urls[1], urls[2]);
    let consumer = scene.consumer_of(list.clone());
    let stats = consumer.stats();
    let relay = scene.relay_of(list);
    let relayed = relay.stats();
    let shutdown = CancellationToken::new();
    let running = scene.runtime.spawn(consumer.run(shutdown.clone()));
    let relaying = scene.runtime.spawn(relay.run(shutdown.clone()));
    let producer = scene.produce(&workload, (0..events()).collect(), 1_000.0);
    let started = scene.runtime.block_on(amqp::eventually(patience(), || {
        stats.snapshot().processed >= u64::try_from(events() / 10).unwrap()
            && relayed.snapshot().published > 0
    }));
    assert!(
        started,
        "the consumer or the relay did not start: {:?} {:?}",
        stats.snapshot(),
        relayed.snapshot()
    );
    proxy.block(true);
    proxy.cut();
    let at_cut = stats.snapshot();
    let relayed_at_cut = relayed.snapshot().published;
    producer.join();
    assert!(
        at_cut.processed < u64::try_from(events()).unwrap(),
        "the cut did not land mid-stream: {at_cut:?}"
    );
    assert!(
        relayed_at_cut < u64::try_from(events()).unwrap(),
        "the cut did not land while the relay published ({relayed_at_cut} published)"
    );
    let end = Ending {
        workload: &workload,
        published,
        stats,
        relay: Some(Relaying {
            stats: relayed,
            running: relaying,
        }),
        shutdown,
        running,
    };
    let what = format!(
        "cut at {} processed, {relayed_at_cut} relayed",
        at_cut.processed
    );
    scene.finish(&what, end, true);
}

/// The outbox into the cluster: producers enqueue every event (about 1,000 a second)
/// while a relay publishes them to the cluster and the consumer applies them, both
/// connected first to the node leading the group's queue, which is killed with
/// `kill -9` once a third are enqueued. The relay's unconfirmed publishes are
/// published again once their lease expires; every outbox row ends published, every
/// event applied once.
#[test]
fn kill_dash_nine_of_the_queues_leader_under_the_relay_loses_and_doubles_nothing() {
    let Some(mut scene) = Scene::new() else {
        return;
    };
    let workload = Workload::generate(events(), 0, 53);
    let queue = scene.queue();
    let (leader, list) = scene.leader_first(&queue);
    let consumer = scene.consumer_of(list.clone());
    let stats = consumer.stats();
    let relay = scene.relay_of(list);
    let relayed = relay.stats();
    let shutdown = CancellationToken::new();
    let running = scene.runtime.spawn(consumer.run(shutdown.clone()));
    let relaying = scene.runtime.spawn(relay.run(shutdown.clone()));
    let producer = scene.produce(&workload, (0..events()).collect(), 1_000.0);
    let third = events() / 3;
    let started = scene.runtime.block_on(amqp::eventually(patience(), || {
        producer.enqueued() >= third
            && relayed.snapshot().published > 0
            && stats.snapshot().processed > 0
    }));
    assert!(
        started,
        "the relay or the consumer did not start: {:?} {:?}",
        relayed.snapshot(),
        stats.snapshot()
    );
    scene.cluster.kill_node(leader).unwrap();
    let at_kill = relayed.snapshot().published;
    producer.join();
    assert!(
        at_kill < u64::try_from(events()).unwrap(),
        "the kill did not land while the relay published ({at_kill} published)"
    );
    let end = Ending {
        workload: &workload,
        published: 0,
        stats,
        relay: Some(Relaying {
            stats: relayed,
            running: relaying,
        }),
        shutdown,
        running,
    };
    scene.finish(
        &format!("leader node {leader} killed at {at_kill} relayed"),
        end,
        true,
    );
}

/// `kill -9` of the node leading the retry tier's queue while the consumer sends
/// poison events (user 0, failing until they are dead-lettered) through the tier and
/// the relay publishes the outbox at about 1,000 rows/s: the consumer's retry copies,
/// refused while the tier elects a new leader, go on a fresh channel after a refusal
/// (a channel that published during the election can go on being nacked); every
/// poison event ends dead, every other event is applied once.
#[test]
fn kill_dash_nine_of_the_retry_tiers_leader_under_retries_loses_and_doubles_nothing() {
    let Some(mut scene) = Scene::new() else {
        return;
    };
    let n = events();
    let workload = Workload::generate(n, n / 2, 59);
    let group = ConsumerGroup::new(GROUP).unwrap();
    let tier = scene
        .topology
        .retry_queue(&group, Duration::from_millis(50));
    let (leader, list) = scene.leader_first(&tier);
    let consumer = scene.consumer_of(list.clone());
    let stats = consumer.stats();
    let relay = scene.relay_of(list);
    let relayed = relay.stats();
    let shutdown = CancellationToken::new();
    let running = scene.runtime.spawn(consumer.run(shutdown.clone()));
    let relaying = scene.runtime.spawn(relay.run(shutdown.clone()));

    // Poison and healthy events interleaved (the workload puts the poison first). The
    // node is killed once a third of the events are enqueued and as many copies sent:
    // with copies flowing as the tier elects its new leader.
    let order: Vec<usize> = (0..n / 2).flat_map(|i| [i, n / 2 + i]).collect();
    let producer = scene.produce(&workload, order, 1_000.0);
    let third = n / 3;
    let started = scene.runtime.block_on(amqp::eventually(patience(), || {
        producer.enqueued() >= third && stats.snapshot().retried >= u64::try_from(third).unwrap()
    }));
    assert!(
        started,
        "the consumer sent too few retry copies: {:?} {:?}",
        relayed.snapshot(),
        stats.snapshot()
    );
    scene.cluster.kill_node(leader).unwrap();
    let at_kill = stats.snapshot();
    producer.join();

    // Every healthy event applied: the worker's copies do not hold it up.
    let healthy = u64::try_from(n / 2).unwrap();
    let applied = scene
        .runtime
        .block_on(amqp::eventually(Duration::from_secs(180), || {
            stats.snapshot().processed >= healthy
        }));
    // Every poison event dead. A retry tier whose leader changed can keep the copies
    // it was to send back (RabbitMQ's at-least-once dead-letter worker, see
    // docs/rabbitmq-cluster.md): their claims stay failed and overdue, and the
    // operator's redrive sends them again, as an operator would.
    let (db, schema) = (scene.db.url().to_owned(), scene.db.schema.clone());
    let all = i64::try_from(n).unwrap();
    let operator = inbox_diesel::operator::Operator::new(&*scene.store);
    let queue = scene.queue();
    let target =
        inbox_diesel::operator::ReplayTarget::with_prefix(queue.strip_suffix(GROUP).unwrap());
    let mut redriven = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    let mut done = false;
    while applied && std::time::Instant::now() < deadline {
        if unpublished(&db, &schema) == 0 && settled(&db, &schema) >= all {
            done = true;
            break;
        }
        let report = operator
            .redrive_failed_claims(
                &inbox_diesel::operator::RedriveFilter::default()
                    .overdue_for(Duration::from_secs(5)),
                None,
                &target,
            )
            .unwrap();
        redriven += report.affected;
        std::thread::sleep(Duration::from_secs(1));
    }
    let published = usize::try_from(relayed.snapshot().published).unwrap();
    let drained = scene.drained(&stats, published);
    shutdown.cancel();
    scene.runtime.block_on(running).unwrap().unwrap();
    scene.runtime.block_on(relaying).unwrap().unwrap();
    let (consumed, relayed) = (stats.snapshot(), relayed.snapshot());
    eprintln!(
        "retry tier's leader node {leader} killed at {} retried, {redriven} claims redriven: relay {relayed:?}, consumer {consumed:?}",
        at_kill.retried
    );
    assert!(
        at_kill.dead_lettered < healthy,
        "the kill did not land while poison was retried: {at_kill:?}"
    );
    assert!(
        applied,
        "the healthy events were held up: {relayed:?} {consumed:?}"
    );
    assert!(
        done,
        "not every event published and settled: {relayed:?} {consumed:?}"
    );
    assert!(
        drained,
        "copies left undelivered in the queue: {consumed:?}"
    );
    assert!(
        consumed.reconnects >= 1,
        "the consumer lost its node: {consumed:?}"
    );
    assert_eq!(
        dead(&db, &schema),
        i64::try_from(n / 2).unwrap(),
        "every poison event dead, no other"
    );
    scene.verdict(&workload, published);
}
