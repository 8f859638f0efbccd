//! `inbox_amqp::serve`: the consumer and the relay of one process end together. A
//! relay that cannot start stops the consumer (the process exits instead of consuming
//! while nothing publishes its outbox or an operator's replays), and the caller's
//! shutdown stops both. A relay whose store keeps failing backs off (jittered pauses
//! under a ceiling doubling up to the connection's `backoff_max`) instead of leasing
//! again every 100 ms. The topology is declared before the relay starts, so the
//! outbox rows of a fresh deployment are routed the first time (a check of the
//! outcome: the race it prevents, the relay publishing before the consumer has
//! declared its queues, does not happen reliably enough here to fail without it).

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use diesel::SqliteConnection;
use inbox_amqp::{CancellationToken, Consumer, Relay, Topology};
use inbox_core::{HandlerError, MessageContext};
use inbox_diesel::Store;
use inbox_test_support::amqp::amqp_url;
use inbox_test_support::{unique_name, SqliteFixture};

#[derive(serde::Deserialize)]
struct Ping {}

#[derive(inbox_core::Handler)]
#[inbox(group = "serve.pings", message = Ping, message_type = "ping", connection = SqliteConnection)]
struct Pings;

impl Pings {
    fn handle(
        &self,
        _: &mut SqliteConnection,
        _: Ping,
        _: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

struct Scene {
    // Dropped first: the retry tiers carry no expiry, so the test deletes them.
    _delete: inbox_test_support::amqp::DeleteOnDrop,
    _db: SqliteFixture,
    store: Arc<Store<SqliteConnection>>,
    topology: Topology,
    amqp: String,
}

impl Scene {
    fn new() -> Option<Self> {
        let amqp = amqp_url()?;
        let db = SqliteFixture::new();
        let store = Store::<SqliteConnection>::builder(format!("sqlite://{}", db.path))
            .handler(Pings)
            .build()
            .unwrap();
        let prefix = format!("{}.", unique_name("serve"));
        let topology = Topology::new("serve")
            .unwrap()
            .prefix(prefix)
            .unwrap()
            .queue_expires(Duration::from_secs(60));
        let routes = inbox_core::InboxStore::routes(&store);
        let delete = inbox_test_support::amqp::DeleteOnDrop::new(
            amqp.clone(),
            topology.clone().with_routes(routes),
        );
        Some(Self {
            _delete: delete,
            _db: db,
            store: Arc::new(store),
            topology,
            amqp,
        })
    }
}

/// A port nothing listens on: the relay's first connection is refused at once.
fn refused_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
}

#[test]
fn a_relay_that_cannot_start_stops_the_consumer() {
    let Some(scene) = Scene::new() else { return };
    let refused = refused_url();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let ended = runtime.block_on(async {
        let consumer = Consumer::new(&scene.amqp, scene.store.clone(), scene.topology.clone());
        let relay = Relay::new(refused.clone(), scene.store.clone());
        let shutdown = CancellationToken::new();
        tokio::time::timeout(
            Duration::from_secs(60),
            inbox_amqp::serve(consumer, relay, shutdown),
        )
        .await
    });
    let ended = ended.expect("serve still running 60 s after its relay failed");
    let err = ended.expect_err("the relay's failure is serve's");
    let port = refused.rsplit(':').next().unwrap().trim_end_matches("/%2f");
    assert!(
        matches!(&err, inbox_amqp::Error::Connect { url, .. } if url.contains(&format!(":{port}"))),
        "the relay's connect error, to its refused port {port}: {err:?}"
    );
}

/// The scene's store, whose recorded halts answer after two seconds.
struct SlowHalts(Arc<Store<SqliteConnection>>);

impl inbox_core::InboxStore for SlowHalts {
    fn process_batch(
        &self,
        group: &inbox_core::ConsumerGroup,
        batch: &[inbox_core::Envelope],
    ) -> inbox_core::Result<Vec<inbox_core::Decision>> {
        self.0.process_batch(group, batch)
    }
    fn routes(&self) -> Vec<(inbox_core::ConsumerGroup, String)> {
        self.0.routes()
    }
    fn dead_letter(
        &self,
        group: &inbox_core::ConsumerGroup,
        envelope: &inbox_core::Envelope,
        reason: inbox_core::DeadLetterReason,
        detail: &str,
    ) -> inbox_core::Result<inbox_core::DeadLetterOutcome> {
        self.0.dead_letter(group, envelope, reason, detail)
    }
}

impl inbox_core::GroupHalts for SlowHalts {
    fn record_halt(&self, cause: &inbox_core::ClaimInvariantViolated) -> inbox_core::Result<()> {
        self.0.record_halt(cause)
    }
    fn halted_groups(&self) -> inbox_core::Result<Vec<inbox_core::ClaimInvariantViolated>> {
        std::thread::sleep(Duration::from_secs(2));
        self.0.halted_groups()
    }
}

#[derive(diesel::QueryableByName)]
struct Row {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    attempts: i32,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    published: bool,
}

fn outbox(db: &SqliteFixture) -> Vec<Row> {
    use diesel::{Connection, RunQueryDsl};
    let mut conn = SqliteConnection::establish(&db.path).unwrap();
    diesel::sql_query(
        "SELECT attempts, last_error, published_at IS NOT NULL AS published \
         FROM outbox_messages ORDER BY id",
    )
    .load(&mut conn)
    .unwrap()
}

#[test]
fn a_fresh_deployments_first_rows_are_routed_the_first_time() {
    let Some(scene) = Scene::new() else { return };
    {
        let mut conn = scene.store.connection().unwrap();
        for i in 0..5 {
            let key = inbox_core::MessageKey::derive("serve", &format!("ping:{i}"), "ping");
            let msg = scene.topology.message(key, "ping", b"{}".to_vec());
            inbox_diesel::enqueue(&mut conn, &msg, scene.store.clock().now()).unwrap();
        }
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let rows = runtime.block_on(async {
        // The consumer reads its halts before it connects: two seconds here, while
        // the relay, connected at once, publishes the five rows.
        let slow = Arc::new(SlowHalts(scene.store.clone()));
        let consumer = Consumer::new(&scene.amqp, slow, scene.topology.clone());
        let relay = Relay::new(&scene.amqp, scene.store.clone());
        let shutdown = CancellationToken::new();
        let serving = tokio::spawn(inbox_amqp::serve(consumer, relay, shutdown.clone()));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let rows = loop {
            let rows = outbox(&scene._db);
            if rows.iter().all(|r| r.published) || std::time::Instant::now() > deadline {
                break rows;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        shutdown.cancel();
        serving.await.unwrap().unwrap();
        rows
    });
    assert_eq!(rows.len(), 5);
    for row in &rows {
        assert!(row.published, "every row published");
        assert_eq!(
            (row.attempts, row.last_error.as_deref()),
            (0, None),
            "published on the first try, never unroutable"
        );
    }
}

#[test]
fn the_callers_shutdown_stops_both() {
    let Some(scene) = Scene::new() else { return };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let ended = runtime.block_on(async {
        let consumer = Consumer::new(&scene.amqp, scene.store.clone(), scene.topology.clone());
        let relay = Relay::new(&scene.amqp, scene.store.clone());
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            stop.cancel();
        });
        let started = std::time::Instant::now();
        let ended = tokio::time::timeout(
            Duration::from_secs(60),
            inbox_amqp::serve(consumer, relay, shutdown),
        )
        .await;
        (ended, started.elapsed())
    });
    let (ended, ran) = ended;
    ended
        .expect("serve still running 58 s after its shutdown")
        .expect("a clean shutdown");
    assert!(
        ran >= Duration::from_secs(2),
        "serve ran until its shutdown, not {ran:?}"
    );
}

/// An outbox whose every lease fails, counting the tries.
struct BrokenOutbox(std::sync::atomic::AtomicU32);

impl inbox_core::OutboxStore for BrokenOutbox {
    fn lease(&self, _: &str, _: usize, _: Duration) -> inbox_core::Result<inbox_core::Lease> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Err(inbox_core::Error::Store("the database is down".into()))
    }
    fn mark_published(&self, _: &str, _: &[i64]) -> inbox_core::Result<usize> {
        Ok(0)
    }
    fn record_failures(&self, _: &str, _: &[inbox_core::OutboxFailure]) -> inbox_core::Result<()> {
        Ok(())
    }
    fn oldest_unpublished_age(&self) -> inbox_core::Result<Option<Duration>> {
        Ok(None)
    }
    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::Utc::now()
    }
}

#[test]
fn a_relay_whose_store_keeps_failing_backs_off() {
    let Some(amqp) = amqp_url() else { return };
    let store = Arc::new(BrokenOutbox(Default::default()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        let relay = Relay::new(&amqp, store.clone());
        let running = tokio::spawn(relay.run(shutdown.clone()));
        tokio::time::sleep(Duration::from_secs(3)).await;
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), running)
            .await
            .expect("the relay stops after its shutdown")
            .unwrap()
            .unwrap();
    });
    // Jittered pauses under a ceiling doubling from 100 ms (at most 5 s): about 7
    // leases in 3 s, and never near the 30 or more of a fixed 100 ms pause.
    let tries = store.0.load(std::sync::atomic::Ordering::SeqCst);
    assert!((1..=15).contains(&tries), "{tries} leases in 3 s");
}
