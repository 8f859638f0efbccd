//! The consumer under faults, against real RabbitMQ and PostgreSQL: a message that
//! crashes its process again and again, `kill -9` mid-batch, a connection cut by a
//! proxy of the test's own, and a shutdown with work in flight. The shared servers are
//! never stopped; crashing consumers are child processes of this test binary.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_core::{ConsumerGroup, Handler, HandlerError, MessageContext, ProjectionLock};
use inbox_diesel::Store;
use inbox_examples::usage::{UsageDb, UsageRecorded, Workload, GROUP, MESSAGE_TYPE};
use inbox_test_support::amqp::{
    self, amqp_url, confirm_channel, publish, queue_depth, wait_for_confirms, Cuts, Outgoing, Proxy,
};
use inbox_test_support::{postgres_url, PgFixture};

const CHILD_ENV: &str = "INBOX_AMQP_CHILD";
const POISON_USER: i64 = 99;

/// The projection, with a fault: it aborts the process on the poison user, and
/// sleeps a little per event when asked to (so batches are in flight for a while).
/// It writes one event at a time, so its batches are serialized.
struct Faulty {
    group: ConsumerGroup,
    abort_on_poison: bool,
    per_event: Duration,
}

impl Handler<PgConnection> for Faulty {
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
        if self.abort_on_poison && msg.user_id == POISON_USER {
            std::process::abort();
        }
        if !self.per_event.is_zero() {
            std::thread::sleep(self.per_event);
        }
        conn.add_usage(msg.user_id, msg.day, msg.amount)?;
        Ok(())
    }

    // One event at a time into shared rows: batches of two workers would deadlock.
    fn lock(&self) -> Option<ProjectionLock> {
        Some(ProjectionLock::serialized("faulty-daily-usage"))
    }
}

fn topology(prefix: &str) -> Topology {
    amqp::test_topology(prefix, &[50, 100, 200])
}

fn consumer(
    url: &str,
    store: Arc<Store<PgConnection>>,
    prefix: &str,
) -> Consumer<Store<PgConnection>> {
    Consumer::new(url, store, topology(prefix)).with_settings(
        ConsumerSettings::default()
            .workers(2)
            .prefetch(50)
            .batch(20, Duration::from_millis(5))
            .backoff(Duration::from_millis(50), Duration::from_millis(500))
            .connect_timeout(Duration::from_secs(1)),
    )
}

fn build_store(url: &str, schema: &str, handler: Faulty) -> Arc<Store<PgConnection>> {
    let store = Store::<PgConnection>::builder(url)
        .schema(schema)
        .pool_size(4)
        .handler(handler)
        .build()
        .unwrap();
    store.connection().unwrap().create_daily_usage().unwrap();
    Arc::new(store)
}

/// Claims settled (done or dead) in a schema.
fn settled(db_url: &str, schema: &str) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    use diesel::RunQueryDsl;
    let mut conn = PgConnection::establish(db_url).unwrap();
    conn.batch_execute(&format!("SET search_path TO \"{schema}\""))
        .unwrap();
    diesel::sql_query("SELECT COUNT(*) AS n FROM inbox_claims WHERE status IN ('done', 'dead')")
        .get_result::<N>(&mut conn)
        .map(|r| r.n)
        .unwrap_or(0)
}

/// Not a test of its own: the body of a consumer child process. It consumes until
/// `expected` claims are settled, then stops gracefully (exit 0), unless it aborts on
/// the poison message first.
#[test]
fn amqp_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [schema, prefix, expected, abort, per_event_ms] = parts[..] else {
        panic!("bad child spec {spec}");
    };
    let db_url = postgres_url().unwrap();
    let url = amqp_url().unwrap();
    let expected: i64 = expected.parse().unwrap();
    let handler = Faulty {
        group: ConsumerGroup::new(GROUP).unwrap(),
        abort_on_poison: abort == "abort",
        per_event: Duration::from_millis(per_event_ms.parse().unwrap()),
    };
    let store = build_store(&db_url, schema, handler);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let consumer = consumer(&url, store, prefix);
        let shutdown = CancellationToken::new();
        let watcher = shutdown.clone();
        let (db, schema) = (db_url.clone(), schema.to_owned());
        tokio::spawn(async move {
            while settled(&db, &schema) < expected {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            watcher.cancel();
        });
        consumer.run(shutdown).await.unwrap();
    });
}

/// Kills the child if the test fails while it runs (it would consume on and on).
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_child(
    schema: &str,
    prefix: &str,
    expected: usize,
    abort: bool,
    per_event_ms: u64,
) -> KillOnDrop {
    Command::new(std::env::current_exe().unwrap())
        .args(["amqp_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(
            CHILD_ENV,
            format!(
                "{schema}|{prefix}|{expected}|{}|{per_event_ms}",
                if abort { "abort" } else { "run" }
            ),
        )
        .spawn()
        .map(KillOnDrop)
        .unwrap()
}

struct Scene {
    db: PgFixture,
    url: String,
    prefix: String,
    store: Arc<Store<PgConnection>>,
    runtime: tokio::runtime::Runtime,
}

impl Scene {
    fn new(per_event: Duration) -> Option<Self> {
        let url = amqp_url()?;
        let db = PgFixture::new()?;
        let prefix = amqp::unique_prefix("t");
        let store = build_store(
            db.url(),
            &db.schema,
            Faulty {
                group: ConsumerGroup::new(GROUP).unwrap(),
                abort_on_poison: false,
                per_event,
            },
        );
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let scene = Self {
            db,
            url,
            prefix,
            store,
            runtime,
        };
        let topology = consumer(&scene.url, Arc::clone(&scene.store), &scene.prefix)
            .topology()
            .clone();
        scene.runtime.block_on(async {
            topology
                .declare(&amqp::connect(&scene.url).await)
                .await
                .unwrap();
        });
        Some(scene)
    }

    fn publish(&self, workload: &Workload) {
        let exchange = topology(&self.prefix).exchange();
        self.runtime.block_on(async {
            let conn = amqp::connect(&self.url).await;
            let channel = confirm_channel(&conn).await;
            for (key, event) in &workload.events {
                let body = serde_json::to_vec(event).unwrap();
                publish(
                    &channel,
                    &exchange,
                    &Outgoing {
                        message_id: Some(key.as_str()),
                        message_type: MESSAGE_TYPE,
                        body: &body,
                        tenant: None,
                    },
                )
                .await;
            }
            wait_for_confirms(&channel).await;
        });
    }

    fn settled(&self) -> i64 {
        settled(self.db.url(), &self.db.schema)
    }

    fn group(&self) -> ConsumerGroup {
        ConsumerGroup::new(GROUP).unwrap()
    }

    fn queue_depth(&self) -> u32 {
        let queue = topology(&self.prefix).queue(&self.group());
        self.runtime
            .block_on(async { queue_depth(&amqp::connect(&self.url).await, &queue).await })
    }

    fn check_exactly_once(&self, workload: &Workload) {
        let found = self.store.connection().unwrap().daily_totals().unwrap();
        assert_eq!(
            found,
            workload.expected_totals(),
            "every effect exactly once"
        );
    }

    fn cleanup(&self) {
        let t = topology(&self.prefix).group(self.group(), [MESSAGE_TYPE]);
        self.runtime.block_on(async {
            t.delete(&amqp::connect(&self.url).await)
                .await
                .expect("delete topology");
        });
    }
}

/// Events for users 1..=20, with the poison user's event at `poison_at`.
fn workload_with_poison(count: usize, seed: u64, poison_at: Option<usize>) -> Workload {
    let mut workload = Workload::generate(count, 0, seed);
    if let Some(i) = poison_at {
        workload.events[i].1.user_id = POISON_USER;
    }
    workload
}

#[test]
fn crash_looping_message_is_dead_lettered_and_the_rest_processed_once() {
    let Some(scene) = Scene::new(Duration::ZERO) else {
        return;
    };
    let mut workload = workload_with_poison(300, 17, Some(150));
    scene.publish(&workload);

    let mut crashes = 0;
    for _ in 0..12 {
        let status = spawn_child(&scene.db.schema, &scene.prefix, 300, true, 1)
            .0
            .wait()
            .unwrap();
        if status.success() {
            break;
        }
        crashes += 1;
    }
    // The first delivery crashes without a mark; then 3 marked starts crash; the next
    // redelivery is dead-lettered without running.
    assert_eq!(crashes, 4, "crashes until the crash limit");
    assert_eq!(scene.settled(), 300);
    let dead = scene.store.dead_letters(&scene.group()).unwrap();
    assert_eq!(dead.len(), 1, "only the poison is dead-lettered: {dead:?}");
    assert_eq!(dead[0].reason, "crash_loop");
    assert_eq!(dead[0].key, workload.events[150].0.as_str());
    // Everything else, including what was in flight during each crash, exactly once.
    workload.events.remove(150);
    scene.check_exactly_once(&workload);
    assert_eq!(scene.queue_depth(), 0);
    scene.cleanup();
}

#[test]
fn kill_dash_nine_mid_batch_then_restart() {
    let Some(scene) = Scene::new(Duration::ZERO) else {
        return;
    };
    let workload = workload_with_poison(1_000, 23, None);
    scene.publish(&workload);

    let mut child = spawn_child(&scene.db.schema, &scene.prefix, 1_000, false, 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while scene.settled() < 200 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // SIGKILL: no shutdown, batches mid-flight.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let at_kill = scene.settled();
    assert!(at_kill < 1_000, "killed before the end ({at_kill} settled)");

    let status = spawn_child(&scene.db.schema, &scene.prefix, 1_000, false, 0)
        .0
        .wait()
        .unwrap();
    assert!(status.success());
    assert_eq!(scene.settled(), 1_000);
    assert!(scene.store.dead_letters(&scene.group()).unwrap().is_empty());
    scene.check_exactly_once(&workload);
    assert_eq!(scene.queue_depth(), 0);
    scene.cleanup();
}

/// Consumes `count` events through a proxy that cuts the connection as `cuts` says
/// once `cut_after` are processed: the consumer reconnects, never stalls, and applies
/// every event exactly once.
fn consume_through_cuts(per_event: Duration, count: usize, cut_after: u64, cuts: Cuts) {
    let Some(scene) = Scene::new(per_event) else {
        return;
    };
    let workload = workload_with_poison(count, 29, None);
    scene.publish(&workload);
    let url = scene.url.clone();
    let stats = scene.runtime.block_on(async {
        let proxy = Proxy::start(amqp::host_port(&url)).await;
        // A 2 s heartbeat: a silent connection is noticed after 4 s.
        let through_proxy = format!("{}?heartbeat=2", proxy.url_for(&url));
        let consumer = consumer(&through_proxy, Arc::clone(&scene.store), &scene.prefix);
        let stats = consumer.stats();
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(consumer.run(shutdown.clone()));
        assert!(
            amqp::eventually(Duration::from_secs(60), || stats.snapshot().processed
                >= cut_after)
            .await
        );
        proxy.cut_as(cuts).await;
        let (db, schema) = (scene.db.url().to_owned(), scene.db.schema.clone());
        let all = i64::try_from(count).unwrap();
        assert!(
            amqp::eventually(Duration::from_secs(90), || settled(&db, &schema) >= all).await,
            "the consumer stalled: {:?}",
            stats.snapshot()
        );
        shutdown.cancel();
        running.await.unwrap().unwrap();
        stats.snapshot()
    });
    // Cuts during a reconnect's backoff find no connection to cut.
    let least = if let Cuts::Repeatedly(_) = cuts { 3 } else { 1 };
    assert!(stats.reconnects >= least, "{stats:?}");
    scene.check_exactly_once(&workload);
    assert_eq!(scene.queue_depth(), 0);
    scene.cleanup();
}

#[test]
fn connection_cut_mid_stream_reconnects_and_applies_everything_once() {
    consume_through_cuts(
        Duration::from_micros(500),
        2_000,
        300,
        Cuts::Once {
            refuse_for: Duration::from_millis(700),
        },
    );
}

/// Twenty cuts land wherever the consumer happens to be: mid-batch, acking,
/// publishing a retry, reconnecting or closing a connection that is already dead.
#[test]
fn connection_cut_again_and_again_never_stalls_and_applies_everything_once() {
    consume_through_cuts(Duration::from_millis(2), 3_000, 100, Cuts::Repeatedly(20));
}

/// The broker falls silent without closing anything, as in a network partition: the
/// missed heartbeats end the connection and the consumer reconnects.
#[test]
fn connection_fallen_silent_is_noticed_by_heartbeats_and_everything_applied_once() {
    consume_through_cuts(Duration::from_millis(1), 2_000, 300, Cuts::Freeze);
}

/// After a cut, the broker accepts new connections for 3 s and never answers them:
/// each reconnect gives up at its connect timeout (1 s here) and tries again.
#[test]
fn reconnect_stalled_mid_handshake_is_given_up_and_tried_again() {
    let stall_for = Duration::from_secs(3);
    consume_through_cuts(
        Duration::from_millis(1),
        2_000,
        300,
        Cuts::Stalling { stall_for },
    );
}

#[test]
fn shutdown_with_work_in_flight_loses_and_doubles_nothing() {
    let Some(scene) = Scene::new(Duration::from_millis(1)) else {
        return;
    };
    let workload = workload_with_poison(1_000, 31, None);
    scene.publish(&workload);
    let first = scene.runtime.block_on(async {
        let consumer = consumer(&scene.url, Arc::clone(&scene.store), &scene.prefix);
        let stats = consumer.stats();
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(consumer.run(shutdown.clone()));
        assert!(
            amqp::eventually(Duration::from_secs(60), || stats.snapshot().processed
                >= 150)
            .await
        );
        shutdown.cancel(); // batches are mid-flight
        running.await.unwrap().expect("graceful stop");
        stats.snapshot()
    });
    let after_stop = scene.settled();
    assert!(after_stop < 1_000, "stopped before the end");
    assert_eq!(
        first.processed as i64, after_stop,
        "every handled batch was committed and counted"
    );
    // Nothing lost: what was not processed is back on the queue, unacked deliveries included.
    assert_eq!(i64::from(scene.queue_depth()) + after_stop, 1_000);

    let second = scene.runtime.block_on(async {
        let consumer = consumer(&scene.url, Arc::clone(&scene.store), &scene.prefix);
        let stats = consumer.stats();
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(consumer.run(shutdown.clone()));
        let (db, schema) = (scene.db.url().to_owned(), scene.db.schema.clone());
        assert!(amqp::eventually(Duration::from_secs(60), || settled(&db, &schema) >= 1_000).await);
        shutdown.cancel();
        running.await.unwrap().unwrap();
        stats.snapshot()
    });
    assert_eq!(first.processed + second.processed, 1_000);
    assert_eq!(
        second.duplicates, 0,
        "everything acked at shutdown stays acked"
    );
    scene.check_exactly_once(&workload);
    scene.cleanup();
}
